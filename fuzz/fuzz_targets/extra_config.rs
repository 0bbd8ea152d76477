//! Fuzz target: the Python package's extra-config reader never panics, names a key in every error, and SGLang's own
//! keys (which it ignores) never change its verdict.
#![no_main]

use hicache_py::config::Settings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let verdict = Settings::parse(text);
    if let Err(error) = &verdict {
        assert!(!error.key.is_empty(), "{error}");
        assert!(error.to_string().starts_with("hicache extra_config key `"), "{error}");
    }
    if let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_str::<serde_json::Value>(text) {
        for (key, value) in [
            ("backend_name", "hicache".into()),
            ("module_path", "hicache.sglang".into()),
            ("class_name", "HiCacheStorage".into()),
            ("interface_v1", serde_json::Value::from(1)),
        ] {
            fields.insert(key.into(), value);
        }
        let with_sglang_keys = Settings::parse(&serde_json::Value::Object(fields).to_string());
        assert_eq!(format!("{verdict:?}"), format!("{with_sglang_keys:?}"));
    }
});
