//! One page file: atomic write (temporary file, then rename), verified read, and namespace-scoped removal.
//!
//! Native pages end with a 16-byte footer: `HCPG`, the format version (u32 LE) and the XXH3-64 of the page bytes
//! (u64 LE). Writes are not fsynced: a page cache that survives the process (kill -9) keeps every renamed file whole,
//! and after a power loss a torn native page fails its checksum and is removed on read.

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

const MAGIC: [u8; 4] = *b"HCPG";
const VERSION: u32 = 1;
/// Bytes of the native footer.
pub(crate) const FOOTER_BYTES: usize = 16;

/// What a read found.
#[derive(Debug)]
pub(crate) enum Read {
    /// The page is in the segments.
    Done,
    /// No such file.
    Missing,
    /// The file is not a whole, intact page; why.
    Corrupt(String),
}

/// Bytes read or written (and checksummed) at a time, small enough to stay in cache between the two.
const CHUNK_BYTES: usize = 1 << 20;

fn footer_with(checksum: u64) -> [u8; FOOTER_BYTES] {
    let mut footer = [0u8; FOOTER_BYTES];
    footer[..4].copy_from_slice(&MAGIC);
    footer[4..8].copy_from_slice(&VERSION.to_le_bytes());
    footer[8..].copy_from_slice(&checksum.to_le_bytes());
    footer
}

/// Reads the page at `path` into `page`, checking its length and, with `footer`, its checksum.
pub(crate) fn read(path: &Path, page: &mut [&mut [u8]], footer: bool) -> io::Result<Read> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Read::Missing),
        Err(error) => return Err(error),
    };
    let page_len: usize = page.iter().map(|segment| segment.len()).sum();
    let expected = page_len + if footer { FOOTER_BYTES } else { 0 };
    let found = file.metadata()?.len();
    if found != expected as u64 {
        return Ok(Read::Corrupt(format!("{found} bytes, expected {expected}")));
    }
    // read and checksum a chunk at a time, while the chunk is still in cache
    let mut hasher = footer.then(Xxh3::new);
    for segment in page.iter_mut() {
        for chunk in segment.chunks_mut(CHUNK_BYTES) {
            match file.read_exact(chunk) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
                    return Ok(Read::Corrupt("shorter than its length when read".into()));
                }
                Err(error) => return Err(error),
            }
            if let Some(hasher) = &mut hasher {
                hasher.update(chunk);
            }
        }
    }
    if let Some(hasher) = hasher {
        let mut stored = [0u8; FOOTER_BYTES];
        if file.read_exact(&mut stored).is_err() {
            return Ok(Read::Corrupt("footer missing".into()));
        }
        let computed = footer_with(hasher.digest());
        if stored[..8] != computed[..8] {
            return Ok(Read::Corrupt("not a hicache page file (bad magic or version)".into()));
        }
        if stored[8..] != computed[8..] {
            return Ok(Read::Corrupt("checksum mismatch".into()));
        }
    }
    Ok(Read::Done)
}

/// Writes `page` (and, with `footer`, its footer) to a temporary file beside `path`, then renames it to `path`.
/// `unique` makes the temporary name unique among concurrent writers.
pub(crate) fn write_atomic(path: &Path, page: &[&[u8]], footer: bool, unique: &str) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("a page path has a parent directory"))?;
    let name = path.file_name().and_then(|name| name.to_str()).ok_or_else(|| io::Error::other("page file name"))?;
    let temp = dir.join(format!(".{name}.tmp-{unique}"));
    let result = (|| {
        let mut file = match File::create_new(&temp) {
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                std::fs::create_dir_all(dir)?;
                File::create_new(&temp)?
            }
            other => other?,
        };
        let mut hasher = footer.then(Xxh3::new);
        for chunk in page.iter().flat_map(|segment| segment.chunks(CHUNK_BYTES)) {
            file.write_all(chunk)?;
            if let Some(hasher) = &mut hasher {
                hasher.update(chunk);
            }
        }
        if let Some(hasher) = hasher {
            file.write_all(&footer_with(hasher.digest()))?;
        }
        std::fs::rename(&temp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

/// Removes every file below `root` whose name `own` accepts (and temporary files of such names); returns how many
/// page files went.
pub(crate) fn remove_tree_files(root: &Path, own: &dyn Fn(&str) -> bool) -> io::Result<u64> {
    let mut removed = 0;
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(error) => return Err(error),
    };
    for entry in entries {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            removed += remove_tree_files(&path, own)?;
            continue;
        }
        let Some(name) = path.file_name().and_then(|name| name.to_str()) else { continue };
        // a temporary file is `.{page file name}.tmp-{unique}`
        let temporary = name.strip_prefix('.').and_then(|rest| rest.rsplit_once(".tmp-")).map(|(page, _)| page);
        let counts = match temporary {
            Some(page) if own(page) => false,
            None if own(name) => true,
            _ => continue,
        };
        match std::fs::remove_file(&path) {
            Ok(()) => removed += u64::from(counts),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
    }
    Ok(removed)
}

/// Calls `found(path, bytes, modified)` for every file below `root`, temporary files excepted.
pub(crate) fn list_files(root: &Path, found: &mut dyn FnMut(&Path, u64, std::time::SystemTime)) -> io::Result<()> {
    for entry in std::fs::read_dir(root)? {
        let entry = entry?;
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            list_files(&path, found)?;
        } else if kind.is_file() && !entry.file_name().to_string_lossy().starts_with('.') {
            let metadata = entry.metadata()?;
            found(&path, metadata.len(), metadata.modified()?);
        }
    }
    Ok(())
}
