//! One page file: atomic write (temporary file, then rename), verified read, optional direct I/O, and
//! namespace-scoped removal.
//!
//! A native page ends with a footer: `HCPG`, the format version (u32 LE) and a checksum (u64 LE), in 16 bytes, or at
//! the start of a zero-filled 4 KiB block when the page is a whole number of 4 KiB blocks (so the whole file can be
//! written and read with `O_DIRECT`). The checksum is the XXH3-64 of the page's *binding* (its namespace digest and
//! key) followed by the page bytes, so a page file copied or renamed onto another key's path, or another namespace's,
//! fails its check. Writes are not fsynced: a page cache that survives the process (kill -9) keeps every renamed file
//! whole, and after a power loss a torn native page fails its checksum and is removed on read.
//!
//! Temporary files are `.{page file name}.tmp-{16 random hex digits}`, created with `O_EXCL`: unique across
//! processes, PID namespaces and hosts sharing a directory, and a writer only ever removes the one it created.
//! Page files are opened with `O_NONBLOCK` and checked to be regular files before anything is read, so a FIFO or a
//! device at a page path is refused instead of blocking.

use std::fs::OpenOptions;
use std::hash::Hasher as _;
use std::io::{self, Read as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use twox_hash::XxHash3_64;

const MAGIC: [u8; 4] = *b"HCPG";
/// Version 2: the checksum covers the binding (namespace digest and key) before the page.
const VERSION: u32 = 2;
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
    /// A native page file that is not a whole, intact page of this key (torn, damaged, another key's): why.
    Corrupt(String),
    /// A file without a footer (SGLang's layout) of another length: it may be another namespace's page, since
    /// SGLang's names cannot tell those apart.
    SizeMismatch(u64),
    /// Something other than a regular file at the page path: what.
    NotAFile(&'static str),
}

/// Opens `path` for reading without blocking on a FIFO or device, and checks that it is a regular file; `Ok(Err)`
/// says what else is there.
fn open_page(path: &Path, direct: bool) -> io::Result<Result<(std::fs::File, u64), Read>> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | if direct { libc::O_DIRECT } else { 0 })
        .open(path)
    {
        Ok(file) => file,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Err(Read::Missing)),
        Err(error) => return Err(error),
    };
    let metadata = file.metadata()?;
    if !metadata.is_file() {
        return Ok(Err(Read::NotAFile(describe(&metadata.file_type()))));
    }
    Ok(Ok((file, metadata.len())))
}

/// What kind of file system object a non-regular file is.
fn describe(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// The verdict on a file of `found` bytes where a page file of `shape` belongs: `None` when the length is right.
fn length_verdict(found: u64, shape: FileShape) -> Option<Read> {
    (found != shape.file_bytes() as u64).then(|| {
        if shape.footer_bytes == 0 {
            Read::SizeMismatch(found)
        } else {
            Read::Corrupt(format!("{found} bytes, expected {}", shape.file_bytes()))
        }
    })
}

/// Reads the page at `path` into `page`, checking its length and (native pages) the footer's checksum over
/// `binding` and the page; with `touch`, an intact page's modification time becomes now (its recency, shared by
/// every process that evicts by it).
pub(crate) fn read(
    path: &Path,
    page: &mut [&mut [u8]],
    shape: FileShape,
    binding: &[u8],
    touch: bool,
) -> io::Result<Read> {
    let (mut file, found) = match open_page(path, shape.use_direct(page))? {
        Ok(opened) => opened,
        Err(verdict) => return Ok(verdict),
    };
    if let Some(verdict) = length_verdict(found, shape) {
        return Ok(verdict);
    }
    // read and checksum a chunk at a time, while the chunk is still in cache
    let mut hasher = (shape.footer_bytes > 0).then(|| bound_hasher(binding));
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
                hasher.write(chunk);
            }
        }
    }
    let verdict = match hasher {
        Some(hasher) => check_footer(&mut file, shape, &hasher)?,
        None => Read::Done,
    };
    if touch && matches!(verdict, Read::Done) {
        // only the file's owner may set it; a page another user wrote keeps its time
        let _ = file.set_modified(std::time::SystemTime::now());
    }
    Ok(verdict)
}

/// Whether the page file at `path` is an intact page of this binding, reading it through a small buffer (a writer
/// that finds a page already there checks it before calling it present).
pub(crate) fn check(path: &Path, shape: FileShape, binding: &[u8]) -> io::Result<Read> {
    let (mut file, found) = match open_page(path, false)? {
        Ok(opened) => opened,
        Err(verdict) => return Ok(verdict),
    };
    if let Some(verdict) = length_verdict(found, shape) {
        return Ok(verdict);
    }
    if shape.footer_bytes == 0 {
        // SGLang's layout has no checksum: a regular file of the right length is all that can be known
        return Ok(Read::Done);
    }
    let mut hasher = bound_hasher(binding);
    let mut buffer = vec![0u8; CHUNK_BYTES.min(shape.page_bytes.max(1))];
    let mut left = shape.page_bytes;
    while left > 0 {
        let chunk = &mut buffer[..left.min(CHUNK_BYTES)];
        match file.read_exact(chunk) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => {
                return Ok(Read::Corrupt("shorter than its length when read".into()));
            }
            Err(error) => return Err(error),
        }
        hasher.write(chunk);
        left -= chunk.len();
    }
    check_footer(&mut file, shape, &hasher)
}

/// A checksum that starts with the page's binding.
fn bound_hasher(binding: &[u8]) -> XxHash3_64 {
    let mut hasher = XxHash3_64::with_seed(0);
    hasher.write(binding);
    hasher
}

/// Reads the footer after the page and compares it with the checksum of what was read.
fn check_footer(file: &mut std::fs::File, shape: FileShape, hasher: &XxHash3_64) -> io::Result<Read> {
    let mut stored = Box::new(Block([0u8; DIRECT_ALIGN]));
    if file.read_exact(&mut stored.0[..shape.footer_bytes]).is_err() {
        return Ok(Read::Corrupt("footer missing".into()));
    }
    let computed = footer_block(hasher.finish());
    if stored.0[..4] != MAGIC {
        return Ok(Read::Corrupt("not a hicache page file (bad magic)".into()));
    }
    if stored.0[4..8] != computed.0[4..8] {
        let version = u32::from_le_bytes(stored.0[4..8].try_into().expect("4 bytes"));
        return Ok(Read::Corrupt(format!("footer version {version}, this hicache writes {VERSION}")));
    }
    if stored.0[8..FOOTER_BYTES] != computed.0[8..FOOTER_BYTES] {
        return Ok(Read::Corrupt("checksum mismatch (damaged, or another key's page)".into()));
    }
    Ok(Read::Done)
}

/// A random name suffix for a temporary file: unique without relying on PIDs, which repeat across containers and
/// hosts sharing a directory.
fn unique_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Makes the folders from `base` (exclusive, which must exist) down to `dir`, one level at a time: a `base` that was
/// removed (a `clear`, or a process cleaning up its temporary directory) is never made again.
pub(crate) fn make_dirs_below(base: &Path, dir: &Path) -> io::Result<()> {
    let below = dir.strip_prefix(base).map_err(|_| io::Error::other("a page path lies below the storage directory"))?;
    let mut path = base.to_path_buf();
    for part in below {
        path.push(part);
        match std::fs::create_dir(&path) {
            Err(error) if error.kind() != io::ErrorKind::AlreadyExists => return Err(error),
            _ => {}
        }
    }
    Ok(())
}

/// Writes `page` and its footer (checksum over `binding` and the page) to a new temporary file beside `path`, then
/// renames it to `path`, replacing what was there; the folders below `base` that the path needs are made. Only the
/// temporary file this call created is ever removed.
pub(crate) fn write_atomic(
    path: &Path,
    page: &[&[u8]],
    shape: FileShape,
    binding: &[u8],
    base: &Path,
) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| io::Error::other("a page path has a parent directory"))?;
    let name = path.file_name().and_then(|name| name.to_str()).ok_or_else(|| io::Error::other("page file name"))?;
    let direct = shape.use_direct(page);
    let mut attempts = 0;
    let (mut file, temp) = loop {
        let temp = dir.join(format!(".{name}.tmp-{}", unique_suffix()));
        match open_options(direct).write(true).create_new(true).open(&temp) {
            Ok(file) => break (file, temp),
            // the shard folder is new, or a `clear` removed it as empty just now: make it and try again
            Err(error) if error.kind() == io::ErrorKind::NotFound && attempts < 3 => make_dirs_below(base, dir)?,
            // another writer's name: draw another
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists && attempts < 3 => {}
            Err(error) => return Err(error),
        }
        attempts += 1;
    };
    let result = (|| {
        let mut hasher = (shape.footer_bytes > 0).then(|| bound_hasher(binding));
        for chunk in page.iter().flat_map(|segment| segment.chunks(CHUNK_BYTES)) {
            file.write_all(chunk)?;
            if let Some(hasher) = &mut hasher {
                hasher.write(chunk);
            }
        }
        if let Some(hasher) = hasher {
            file.write_all(&footer_block(hasher.finish()).0[..shape.footer_bytes])?;
        }
        drop(file);
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

/// Whether a native namespace folder's pages go to segment files: yes when it holds segments already, no when it
/// holds page files already (shard folders of two hex digits), else when its pages are `small`. So a namespace
/// written in one layout keeps it whatever the threshold says now.
pub(crate) fn chooses_segments(root: &Path, small: bool) -> io::Result<bool> {
    if root.join(crate::segment::FOLDER).is_dir() {
        return Ok(true);
    }
    if !small {
        return Ok(false);
    }
    let mut shards = false;
    for_each_entry(root, &mut |entry| {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.len() == 2 && name.bytes().all(|byte| byte.is_ascii_hexdigit()) && entry.file_type()?.is_dir() {
            shards = true;
        }
        Ok(())
    })?;
    Ok(!shards)
}

/// Calls `visit` with each entry of `dir`; a missing `dir` has none. Errors name the folder.
fn for_each_entry(dir: &Path, visit: &mut dyn FnMut(std::fs::DirEntry) -> io::Result<()>) -> io::Result<()> {
    match std::fs::read_dir(dir) {
        Ok(entries) => each_entry(dir, entries, visit),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(with_path(error, dir)),
    }
}

/// Calls `visit` with each of `entries`, the entries of `dir`. Errors name the folder.
fn each_entry(
    dir: &Path,
    entries: std::fs::ReadDir,
    visit: &mut dyn FnMut(std::fs::DirEntry) -> io::Result<()>,
) -> io::Result<()> {
    for entry in entries {
        visit(entry.map_err(|error| with_path(error, dir))?)?;
    }
    Ok(())
}

/// `look(entry)`, or `None` when the entry vanished since its folder was read (a concurrent `clear` or eviction);
/// other errors name the entry.
fn if_present<T>(
    entry: &std::fs::DirEntry,
    look: impl Fn(&std::fs::DirEntry) -> io::Result<T>,
) -> io::Result<Option<T>> {
    match look(entry) {
        Ok(found) => Ok(Some(found)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(with_path(error, &entry.path())),
    }
}

/// The page file name a temporary file (`.{page file name}.tmp-{unique}`, as [`write_atomic`] names it) is for.
fn temporary_page_name(name: &str) -> Option<&str> {
    name.strip_prefix('.').and_then(|rest| rest.rsplit_once(".tmp-")).map(|(page, _)| page)
}

/// Removes the empty folders below `root`, deepest first (not `root` itself); a folder another writer has just put
/// a file into stays.
pub(crate) fn remove_empty_dirs(root: &Path) -> io::Result<()> {
    for_each_entry(root, &mut |entry| {
        if entry.file_type()?.is_dir() {
            let path = entry.path();
            remove_empty_dirs(&path)?;
            // not empty (a file arrived) or gone already: either way nothing to do
            let _ = std::fs::remove_dir(&path);
        }
        Ok(())
    })
}

/// Removes every regular file in `root` (and below it when `recurse`) that `own(name, length)` accepts, and
/// temporary files of such names (whatever their length); returns how many page files went. Files that vanish
/// meanwhile are not an error.
pub(crate) fn remove_tree_files(
    root: &Path,
    recurse: bool,
    own: &dyn Fn(&str, Option<u64>) -> bool,
) -> io::Result<u64> {
    let mut removed = 0;
    for_each_entry(root, &mut |entry| {
        let path = entry.path();
        let Some(kind) = if_present(&entry, std::fs::DirEntry::file_type)? else { return Ok(()) };
        if kind.is_dir() {
            if recurse {
                removed += remove_tree_files(&path, recurse, own)?;
            }
            return Ok(());
        }
        let Some(name) = path.file_name().and_then(|name| name.to_str()).filter(|_| kind.is_file()) else {
            return Ok(());
        };
        let counts = match temporary_page_name(name) {
            Some(page) if own(page, None) => false,
            Some(_) => return Ok(()),
            None => match if_present(&entry, std::fs::DirEntry::metadata)? {
                Some(metadata) if own(name, Some(metadata.len())) => true,
                _ => return Ok(()),
            },
        };
        match std::fs::remove_file(&path) {
            Ok(()) => removed += u64::from(counts),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        Ok(())
    })?;
    Ok(removed)
}

/// Removes the temporary files in `root` (and below it when `recurse`) of page names `own` accepts that were last
/// modified more than `age` ago: what writers killed mid-write left (a live writer's file is seconds old). Returns
/// how many went.
pub(crate) fn remove_stale_temporaries(
    root: &Path,
    recurse: bool,
    own: &dyn Fn(&str) -> bool,
    age: std::time::Duration,
) -> io::Result<u64> {
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for_each_entry(root, &mut |entry| {
        let Ok(kind) = entry.file_type() else { return Ok(()) };
        if kind.is_dir() {
            if recurse {
                removed += remove_stale_temporaries(&entry.path(), recurse, own, age)?;
            }
            return Ok(());
        }
        let name = entry.file_name();
        if name.to_str().and_then(temporary_page_name).is_some_and(own)
            && let Ok(modified) = entry.metadata().and_then(|metadata| metadata.modified())
            && now.duration_since(modified).is_ok_and(|elapsed| elapsed > age)
            && std::fs::remove_file(entry.path()).is_ok()
        {
            removed += 1;
        }
        Ok(())
    })?;
    Ok(removed)
}

/// Calls `found(path, bytes, modified)` for every regular file in `root` (and below it when `recurse`), temporary
/// files excepted. A file or folder that vanishes meanwhile (a concurrent `clear` or eviction) is skipped; a folder
/// below `root` that cannot be read (permissions, a broken mount) is skipped and told to `unreadable`, so one bad
/// shard does not hide the others; other errors name the path they happened at.
pub(crate) fn list_files(
    root: &Path,
    recurse: bool,
    found: &mut dyn FnMut(&Path, u64, std::time::SystemTime),
    unreadable: &mut dyn FnMut(&Path, &io::Error),
) -> io::Result<()> {
    match std::fs::read_dir(root) {
        Ok(entries) => list_entries(root, entries, recurse, found, unreadable),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(with_path(error, root)),
    }
}

/// [`list_files`] over `entries`, those of `dir`.
fn list_entries(
    dir: &Path,
    entries: std::fs::ReadDir,
    recurse: bool,
    found: &mut dyn FnMut(&Path, u64, std::time::SystemTime),
    unreadable: &mut dyn FnMut(&Path, &io::Error),
) -> io::Result<()> {
    each_entry(dir, entries, &mut |entry| {
        let path = entry.path();
        let Some(kind) = if_present(&entry, std::fs::DirEntry::file_type)? else { return Ok(()) };
        if kind.is_dir() {
            if recurse {
                match std::fs::read_dir(&path) {
                    Ok(below) => list_entries(&path, below, recurse, found, unreadable)?,
                    Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                    Err(error) => unreadable(&path, &error),
                }
            }
        } else if kind.is_file()
            && !entry.file_name().to_string_lossy().starts_with('.')
            && let Some(metadata) = if_present(&entry, std::fs::DirEntry::metadata)?
        {
            found(&path, metadata.len(), metadata.modified().map_err(|error| with_path(error, &path))?);
        }
        Ok(())
    })
}

/// `error`, saying which path it happened at.
fn with_path(error: io::Error, path: &Path) -> io::Error {
    io::Error::new(error.kind(), format!("{}: {error}", path.display()))
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
