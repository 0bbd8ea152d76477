//! Fuzz target: the 3FS settings reader (SGLang's JSON keys) never panics, names a key in every error, and what it
//! accepts reads back the same when written out again.
#![no_main]

use hicache_core::Error;
use hicache_storage_3fs::Hf3fsConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    match Hf3fsConfig::from_json(&value) {
        Err(Error::InvalidConfig { field, reason }) => {
            assert!(!field.is_empty() && !reason.is_empty());
        }
        Err(other) => panic!("not a config error: {other}"),
        Ok(config) => {
            assert!(config.file_size > 0 && config.numjobs > 0 && config.entries > 0);
            let mut written = serde_json::json!({
                "file_path_prefix": config.file_path_prefix.to_str().expect("read from a JSON string"),
                "file_size": config.file_size,
                "numjobs": config.numjobs,
                "entries": config.entries,
            });
            if let Some(url) = &config.metadata_server_url {
                written["metadata_server_url"] = url.clone().into();
            }
            if let Some(dir) = &config.library_dir {
                written["library_dir"] = dir.to_str().expect("read from a JSON string").into();
            }
            let again = Hf3fsConfig::from_json(&written).expect("what was accepted is accepted again");
            assert_eq!(
                (&again.file_path_prefix, again.file_size, again.numjobs, again.entries),
                (&config.file_path_prefix, config.file_size, config.numjobs, config.entries)
            );
            assert_eq!((&again.metadata_server_url, &again.library_dir), (&config.metadata_server_url, &config.library_dir));
        }
    }
});
