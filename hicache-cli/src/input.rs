//! Text files the CLI reads (configs, token files), each bounded in size: `/dev/zero` or a wrong path to a huge
//! file is refused with the limit named, instead of filling memory.

use std::io::Read;
use std::path::Path;

use crate::exit::Usage;

/// The largest config file read (a config is a few hundred bytes).
pub(crate) const CONFIG_LIMIT: u64 = 1 << 20;

/// The largest token file read (decimal ids: some 30 million tokens).
pub(crate) const TOKENS_LIMIT: u64 = 256 << 20;

/// The text of `path` (standard input for `None` or `-`), `what` it is naming it in errors, at most `limit` bytes.
///
/// # Errors
///
/// [`Usage`] when it cannot be read, is not UTF-8 or is larger than `limit`.
pub(crate) fn read_text(path: Option<&Path>, what: &str, limit: u64) -> anyhow::Result<String> {
    let (name, reader): (String, Box<dyn Read>) = match path {
        Some(path) if path.as_os_str() != "-" => {
            let file = std::fs::File::open(path)
                .map_err(|error| Usage(format!("cannot read {what} {}: {error}", path.display())))?;
            (path.display().to_string(), Box::new(file))
        }
        _ => ("standard input".to_owned(), Box::new(std::io::stdin())),
    };
    let mut bytes = Vec::new();
    reader
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| Usage(format!("cannot read {what} {name}: {error}")))?;
    if bytes.len() as u64 > limit {
        return Err(Usage(format!("{what} {name} is larger than {} MiB, the limit for a {what}", limit >> 20)).into());
    }
    String::from_utf8(bytes).map_err(|error| Usage(format!("{what} {name} is not text: {error}")).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_past_the_limit_are_refused_by_name_and_limit() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), vec![b'7'; (1 << 20) + 1]).unwrap();
        let error = read_text(Some(file.path()), "config", CONFIG_LIMIT).unwrap_err().to_string();
        assert!(error.contains("is larger than 1 MiB, the limit for a config"), "{error}");
        std::fs::write(file.path(), vec![b'7'; 1 << 20]).unwrap();
        assert_eq!(read_text(Some(file.path()), "config", CONFIG_LIMIT).unwrap().len(), 1 << 20);
        let error = read_text(Some(Path::new("/dev/zero")), "token file", TOKENS_LIMIT).unwrap_err().to_string();
        assert!(error.contains("/dev/zero is larger than 256 MiB"), "{error}");
        std::fs::write(file.path(), [0xff, 0xfe]).unwrap();
        assert!(read_text(Some(file.path()), "config", CONFIG_LIMIT).unwrap_err().to_string().contains("not text"));
    }
}
