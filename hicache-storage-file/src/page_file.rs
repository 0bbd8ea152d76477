//! One page file: atomic write (temporary file, then rename), verified read, optional direct I/O, and
//! namespace-scoped removal.
//!
//! A native page ends with a footer: `HCPG`, the format version (u32 LE) and the XXH3-64 of the page bytes (u64 LE),
//! in 16 bytes, or at the start of a zero-filled 4 KiB block when the page is a whole number of 4 KiB blocks (so the
//! whole file can be written and read with `O_DIRECT`). Writes are not fsynced: a page cache that survives the
//! process (kill -9) keeps every renamed file whole, and after a power loss a torn native page fails its checksum
//! and is removed on read.

use std::fs::OpenOptions;
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

const MAGIC: [u8; 4] = *b"HCPG";
const VERSION: u32 = 1;
/// The footer's meaningful bytes.
const FOOTER_BYTES: usize = 16;
/// Alignment (of addresses, lengths and offsets) that `O_DIRECT` needs here.
pub(crate) const DIRECT_ALIGN: usize = 4096;
/// Bytes read or written (and checksummed) at a time, small enough to stay in cache between the two.
const CHUNK_BYTES: usize = 1 << 20;

/// How page files of one backend are laid out and accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileShape {
    /// Bytes of the page.
    pub(crate) page_bytes: usize,
    /// Bytes after the page: 0 (SGLang layout), 16, or 4096 (native pages of whole 4 KiB blocks).
    pub(crate) footer_bytes: usize,
    /// Open with `O_DIRECT` when the caller's segments allow it.
    pub(crate) direct: bool,
}

impl FileShape {
    /// The shape of a page of `page_bytes`, with or without a footer.
    pub(crate) fn new(page_bytes: usize, footer: bool, direct: bool) -> Self {
        let footer_bytes = match (footer, page_bytes.is_multiple_of(DIRECT_ALIGN)) {
            (false, _) => 0,
            (true, true) => DIRECT_ALIGN,
            (true, false) => FOOTER_BYTES,
        };
        Self { page_bytes, footer_bytes, direct }
    }

    /// Size of a page file.
    pub(crate) fn file_bytes(&self) -> usize {
        self.page_bytes + self.footer_bytes
    }

    /// Whether this transfer can bypass the page cache: direct I/O on, the file and every segment in whole aligned
    /// blocks.
    pub(crate) fn use_direct<S: AsRef<[u8]>>(&self, segments: &[S]) -> bool {
        self.direct
            && self.page_bytes.is_multiple_of(DIRECT_ALIGN)
            && self.footer_bytes != FOOTER_BYTES
            && segments.iter().all(|segment| {
                let segment = segment.as_ref();
                segment.as_ptr().align_offset(DIRECT_ALIGN) == 0 && segment.len().is_multiple_of(DIRECT_ALIGN)
            })
    }
}

/// One aligned 4 KiB block, for the footer of direct I/O.
#[repr(C, align(4096))]
struct Block([u8; DIRECT_ALIGN]);

fn footer_block(checksum: u64) -> Box<Block> {
    let mut block = Box::new(Block([0u8; DIRECT_ALIGN]));
    block.0[..4].copy_from_slice(&MAGIC);
    block.0[4..8].copy_from_slice(&VERSION.to_le_bytes());
    block.0[8..FOOTER_BYTES].copy_from_slice(&checksum.to_le_bytes());
    block
}

fn open_options(direct: bool) -> OpenOptions {
    let mut options = OpenOptions::new();
    if direct {
        options.custom_flags(libc::O_DIRECT);
    }
    options
}

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

/// Reads the page at `path` into `page`, checking its length and the footer's checksum.
pub(crate) fn read(path: &Path, page: &mut [&mut [u8]], shape: FileShape) -> io::Result<Read> {
    let direct = shape.use_direct(page);
    let mut file = match open_options(direct).read(true).open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Read::Missing),
        Err(error) => return Err(error),
    };
    let found = file.metadata()?.len();
    if found != shape.file_bytes() as u64 {
        return Ok(Read::Corrupt(format!("{found} bytes, expected {}", shape.file_bytes())));
    }
    // read and checksum a chunk at a time, while the chunk is still in cache
    let mut hasher = (shape.footer_bytes > 0).then(Xxh3::new);
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
        let mut stored = Box::new(Block([0u8; DIRECT_ALIGN]));
        if file.read_exact(&mut stored.0[..shape.footer_bytes]).is_err() {
            return Ok(Read::Corrupt("footer missing".into()));
        }
        let computed = footer_block(hasher.digest());
        if stored.0[..8] != computed.0[..8] {
            return Ok(Read::Corrupt("not a hicache page file (bad magic or version)".into()));
        }
        if stored.0[8..FOOTER_BYTES] != computed.0[8..FOOTER_BYTES] {
            return Ok(Read::Corrupt("checksum mismatch".into()));
        }
    }
    Ok(Read::Done)
}

/// Writes `page` and its footer to a temporary file beside `path`, then renames it to `path`. `unique` makes the
/// temporary name unique among concurrent writers.
pub(crate) fn write_atomic(path: &Path, page: &[&[u8]], shape: FileShape, unique: &str) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("a page path has a parent directory"))?;
    let name = path.file_name().and_then(|name| name.to_str()).ok_or_else(|| io::Error::other("page file name"))?;
    let temp = dir.join(format!(".{name}.tmp-{unique}"));
    let direct = shape.use_direct(page);
    let create = || open_options(direct).write(true).create_new(true).open(&temp);
    let result = (|| {
        let mut file = match create() {
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                // the shard folder is new, or a `clear` removed it as empty just now: make it and try again
                let mut attempts = 0;
                loop {
                    std::fs::create_dir_all(dir)?;
                    match create() {
                        Err(error) if error.kind() == io::ErrorKind::NotFound && attempts < 3 => attempts += 1,
                        other => break other?,
                    }
                }
            }
            other => other?,
        };
        let mut hasher = (shape.footer_bytes > 0).then(Xxh3::new);
        for chunk in page.iter().flat_map(|segment| segment.chunks(CHUNK_BYTES)) {
            file.write_all(chunk)?;
            if let Some(hasher) = &mut hasher {
                hasher.update(chunk);
            }
        }
        if let Some(hasher) = hasher {
            file.write_all(&footer_block(hasher.digest()).0[..shape.footer_bytes])?;
        }
        std::fs::rename(&temp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

/// Checks that `dir`'s file system accepts `O_DIRECT` (tmpfs, for one, does not).
pub(crate) fn probe_direct(dir: &Path) -> io::Result<()> {
    let probe = dir.join(format!(".hicache-direct-probe-{}", std::process::id()));
    let result = open_options(true).write(true).create(true).truncate(true).open(&probe).and_then(|mut file| {
        file.write_all(&Block([0u8; DIRECT_ALIGN]).0)?;
        drop(file);
        let mut block = Box::new(Block([0u8; DIRECT_ALIGN]));
        open_options(true).read(true).open(&probe)?.read_exact(&mut block.0)
    });
    let _ = std::fs::remove_file(&probe);
    result
}

/// Removes every file below `root` whose name `own` accepts (and temporary files of such names); returns how many
/// page files went.
/// Removes the empty folders below `root`, deepest first (not `root` itself); a folder another writer has just put
/// a file into stays.
pub(crate) fn remove_empty_dirs(root: &Path) -> io::Result<()> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) => return Err(error),
    };
    for entry in entries {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            let path = entry.path();
            remove_empty_dirs(&path)?;
            // not empty (a file arrived) or gone already: either way nothing to do
            let _ = std::fs::remove_dir(&path);
        }
    }
    Ok(())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footers_fill_a_block_only_for_block_sized_pages() {
        assert_eq!(FileShape::new(8 << 20, true, false).file_bytes(), (8 << 20) + 4096);
        assert_eq!(FileShape::new(512, true, false).file_bytes(), 512 + 16);
        assert_eq!(FileShape::new(512, false, true).file_bytes(), 512);
    }

    #[test]
    fn direct_io_only_for_aligned_segments() {
        let shape = FileShape::new(2 * DIRECT_ALIGN, true, true);
        let blocks = [Block([1u8; DIRECT_ALIGN]), Block([2u8; DIRECT_ALIGN])];
        let aligned: Vec<&[u8]> = blocks.iter().map(|block| &block.0[..]).collect();
        assert!(shape.use_direct(&aligned));
        assert!(!shape.use_direct(&[&blocks[0].0[1..], &blocks[1].0[..]]), "an unaligned segment reads buffered");
        assert!(!FileShape::new(2 * DIRECT_ALIGN, true, false).use_direct(&aligned), "off unless asked for");
        assert!(!FileShape::new(DIRECT_ALIGN + 512, true, true).use_direct(&aligned), "the file must be whole blocks");
    }
}
