//! The backend's settings, read from SGLang's extra config: hicache-core's reader (`hicache_core::extra_config`),
//! which the CLI's `config check` shares, over the table of tiers this build links.

pub use hicache_core::extra_config::*;

/// The storage tiers this build links, from the table of tiers the CLI reads too (`hicache.BACKENDS`).
pub fn tier_names() -> Vec<&'static str> {
    hicache_core::storage::tiers::all().iter().map(|tier| tier.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_registered_in_its_own_crate_is_one_the_package_takes() {
        // `probe` is registered only by hicache-core's `testing` feature; nothing in this crate names it
        let names = tier_names();
        for name in ["file", "memory", "probe"] {
            assert!(names.contains(&name), "{name} in {names:?}");
        }
        let settings = Settings::parse(r#"{"backend": "probe-alias", "label": "x"}"#).unwrap();
        assert_eq!(settings.tier.name, "probe");
        let error = Settings::parse(r#"{"backend": "probe", "label": 1}"#).unwrap_err();
        assert_eq!((error.key.as_str(), error.wrong_type), ("label", true));
        let error = Settings::parse(r#"{"backend": "probe", "dir": "/d"}"#).unwrap_err().to_string();
        assert!(error.contains("key `dir`: unknown key for the probe tier (it takes: label)"), "{error}");
        // the file tier is the default, and its keys are read by its own crate
        let error = Settings::parse(r#"{"capacty": 1}"#).unwrap_err().to_string();
        assert!(error.contains("key `capacty`: unknown key for the file tier"), "{error}");
    }
}
