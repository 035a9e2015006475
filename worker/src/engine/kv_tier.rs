//! The second KV tier: full blocks the device pool evicts, kept under their prefix hash
//! in host memory and, below it, on disk; a prompt whose prefix continues into them
//! copies them back instead of computing them again.
//!
//! A block's bytes live in exactly one place that claims its hash: the device pool, the
//! host tier or the disk tier. An evicted block moves down (device → host → disk, each
//! tier dropping its least recently used when full), a block found moves back up to the
//! device and leaves the tier, and a block the device computes again is dropped from the
//! tiers (`forget`). Nothing here touches the device: the scheduler says which blocks
//! move (`Step::offload`, `Step::onload`) and the engine copies them.
//!
//! Disk is slow next to a step: files are written on a thread of their own, and the
//! blocks a waiting prompt needs from disk are read ahead on another (`ready`), the
//! prompt admitted once they are in memory while the running sequences go on.
//!
//! The disk tier survives a restart: its files sit in a folder named for the model's
//! identity (model, weights, KV layout), each headed by that identity and its hash,
//! written whole under a temporary name and renamed, and checked again when read.

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tessera_proto::block_hash::BlockHash;

/// Where a block of the second tier is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Host,
    Disk,
}

/// The tiers' sizes, and what the disk tier's blocks must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes of host memory for evicted blocks (0: none).
    pub host_bytes: u64,
    /// A folder for evicted blocks, and the bytes it may take.
    pub disk: Option<(PathBuf, u64)>,
    /// What makes a block's contents: the model, its weights, the backend and the KV
    /// layout. The disk tier serves only blocks written under the same identity.
    pub identity: String,
}

impl TierConfig {
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0 || self.disk.as_ref().is_some_and(|(_, bytes)| *bytes > 0)
    }
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks (and bytes) the device evicted into the tiers.
    pub offloaded_blocks: u64,
    pub offloaded_bytes: u64,
    /// Blocks (and bytes) copied back to the device, by the tier they came from.
    pub host_hits: u64,
    pub disk_hits: u64,
    pub onloaded_bytes: u64,
    /// Blocks moved from host to disk.
    pub spilled_blocks: u64,
    /// Blocks dropped for room, from the lowest tier.
    pub dropped_blocks: u64,
    /// Disk reads and writes that failed (the block is then recomputed).
    pub disk_errors: u64,
}

/// What changed in the tiers, for the router's prefix index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierEvents {
    pub stored: Vec<(BlockHash, Tier)>,
    /// Gone from the tiers (to the device, or dropped).
    pub removed: Vec<BlockHash>,
}

/// Blocks by hash, least recently used first, within a byte budget.
#[derive(Debug, Default)]
struct Lru {
    entries: HashMap<BlockHash, (u64, u64)>,
    order: BTreeMap<u64, BlockHash>,
    tick: u64,
    bytes: u64,
}

impl Lru {
    fn insert(&mut self, hash: BlockHash, bytes: u64) {
        self.remove(hash);
        self.tick += 1;
        self.entries.insert(hash, (self.tick, bytes));
        self.order.insert(self.tick, hash);
        self.bytes += bytes;
    }

    fn remove(&mut self, hash: BlockHash) -> bool {
        let Some((tick, bytes)) = self.entries.remove(&hash) else { return false };
        self.order.remove(&tick);
        self.bytes -= bytes;
        true
    }

    fn oldest(&self) -> Option<BlockHash> {
        self.order.values().next().copied()
    }

    fn contains(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash)
    }
}

/// The host and disk tiers of one engine.
pub struct KvTiers {
    host_capacity: u64,
    host: Lru,
    host_data: HashMap<BlockHash, Arc<Vec<u8>>>,
    disk: Option<DiskTier>,
    stats: TierStats,
    events: TierEvents,
}

impl KvTiers {
    /// The tiers `config` asks for; the disk tier serves only blocks this engine made (or
    /// one exactly like it before a restart: `TierConfig::identity`).
    pub fn open(config: &TierConfig) -> std::io::Result<Self> {
        let disk = match &config.disk {
            Some((path, bytes)) if *bytes > 0 => Some(DiskTier::open(path, *bytes, &config.identity)?),
            _ => None,
        };
        let mut tiers = Self {
            host_capacity: config.host_bytes,
            host: Lru::default(),
            host_data: HashMap::new(),
            disk,
            stats: TierStats::default(),
            events: TierEvents::default(),
        };
        if let Some(disk) = &tiers.disk {
            tiers.events.stored.extend(disk.lru.order.values().map(|&h| (h, Tier::Disk)));
        }
        Ok(tiers)
    }

    pub fn stats(&self) -> TierStats {
        self.stats
    }

    /// Bytes held now: host, disk.
    pub fn occupancy(&self) -> (u64, u64) {
        (self.host.bytes, self.disk.as_ref().map_or(0, |d| d.lru.bytes))
    }

    /// Blocks held now: host, disk.
    pub fn blocks(&self) -> (usize, usize) {
        (self.host.entries.len(), self.disk.as_ref().map_or(0, |d| d.lru.entries.len()))
    }

    /// Every block held now and where: what a new watcher of the cache starts from.
    pub fn held(&self) -> Vec<(BlockHash, Tier)> {
        let host = self.host.entries.keys().map(|&h| (h, Tier::Host));
        let disk = self.disk.iter().flat_map(|d| d.lru.entries.keys().map(|&h| (h, Tier::Disk)));
        host.chain(disk).collect()
    }

    pub fn take_events(&mut self) -> TierEvents {
        self.drop_failed_writes();
        std::mem::take(&mut self.events)
    }

    /// Where `hash` is held, if it is.
    pub fn find(&self, hash: BlockHash) -> Option<Tier> {
        if self.host.contains(hash) {
            Some(Tier::Host)
        } else if self.disk.as_ref().is_some_and(|d| d.lru.contains(hash)) {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// Whether the held blocks of `hashes` can be copied to the device without a step
    /// waiting on the disk. Those that cannot are asked for: read ahead off the step
    /// (`wait_for_read` waits for one), they are ready at a later call.
    pub fn ready(&mut self, hashes: &[BlockHash]) -> bool {
        let Some(disk) = self.disk.as_mut() else { return true };
        disk.poll();
        let wanted: HashSet<BlockHash> = hashes.iter().copied().collect();
        let mut ready = true;
        let mut room = true;
        for &hash in hashes {
            if room && !self.host.contains(hash) && disk.lru.contains(hash) {
                // Every block is asked for, not only up to the first that is not ready;
                // once the read-ahead is full the rest are read when taken.
                match disk.ready(hash, &wanted) {
                    Readiness::Ready => {}
                    Readiness::Asked => ready = false,
                    Readiness::NoRoom => room = false,
                }
            }
        }
        ready
    }

    /// A new admission pass: blocks a prompt waiting in it wants are not given up for
    /// another's read-ahead (`DiskTier::ahead_room`).
    pub fn start_pass(&mut self) {
        if let Some(disk) = &mut self.disk {
            disk.passes += 1;
        }
    }

    /// The most bytes read ahead at once (`READ_AHEAD_BYTES` unless set; 0: none, every
    /// block read when taken).
    pub fn set_read_ahead(&mut self, bytes: u64) {
        if let Some(disk) = &mut self.disk {
            disk.ahead_limit = bytes;
        }
    }

    /// Waits for a block being read ahead to come in (one that came in since the last
    /// look counts); false if none did and none is being read.
    pub fn wait_for_read(&mut self) -> bool {
        self.disk.as_mut().is_some_and(DiskTier::wait_for_read)
    }

    /// Keeps a block the device evicted: in host memory while it fits (the oldest there
    /// moving to disk), else on disk, else nowhere.
    pub fn put(&mut self, hash: BlockHash, data: Arc<Vec<u8>>) {
        self.stats.offloaded_blocks += 1;
        self.stats.offloaded_bytes += data.len() as u64;
        self.keep(hash, data);
    }

    /// Returns a block `take` gave out that never reached the device (the step that was
    /// to fill it gave its room to another): kept again, counted neither as evicted nor
    /// as a hit.
    pub fn put_back(&mut self, hash: BlockHash, data: Arc<Vec<u8>>) {
        self.keep(hash, data);
    }

    /// A block the device has been given from `tier`: a hit, counted once the step that
    /// copies it in is formed (`put_back` returns the others).
    pub fn onloaded(&mut self, tier: Tier, bytes: u64) {
        match tier {
            Tier::Host => self.stats.host_hits += 1,
            Tier::Disk => self.stats.disk_hits += 1,
        }
        self.stats.onloaded_bytes += bytes;
    }

    fn keep(&mut self, hash: BlockHash, data: Arc<Vec<u8>>) {
        self.forget(hash);
        let bytes = data.len() as u64;
        if bytes <= self.host_capacity {
            while self.host.bytes + bytes > self.host_capacity {
                let Some(oldest) = self.host.oldest() else { break };
                self.host.remove(oldest);
                let spilled = self.host_data.remove(&oldest).expect("host entries have data");
                self.stats.spilled_blocks += 1;
                self.write_down(oldest, spilled);
            }
            self.host.insert(hash, bytes);
            self.host_data.insert(hash, data);
            self.events.stored.push((hash, Tier::Host));
        } else {
            self.write_down(hash, data);
        }
    }

    /// Takes a block out of the tiers for the device: its bytes and the tier it was in
    /// (from disk: read ahead, else read now). None if it is not held, or its file could
    /// not be read back whole (then it is dropped, and the block is computed again). The
    /// hit is counted by `onloaded`.
    pub fn take(&mut self, hash: BlockHash) -> Option<(Arc<Vec<u8>>, Tier)> {
        if self.host.remove(hash) {
            let data = self.host_data.remove(&hash).expect("host entries have data");
            self.events.removed.push(hash);
            return Some((data, Tier::Host));
        }
        let disk = self.disk.as_mut()?;
        if !disk.lru.contains(hash) {
            return None;
        }
        let read = disk.read(hash);
        disk.remove(hash);
        self.events.removed.push(hash);
        match read {
            Ok(data) => Some((data, Tier::Disk)),
            Err(e) => {
                tracing::warn!("KV block {hash:016x} could not be read back from disk ({e}); computing it again");
                self.stats.disk_errors += 1;
                None
            }
        }
    }

    /// The disk tier's size, when there is one.
    pub fn disk_capacity(&self) -> Option<u64> {
        self.disk.as_ref().map(|d| d.capacity)
    }

    /// At shutdown: the newest blocks in host memory, up to `bytes` of them, move to disk
    /// (oldest first), so that a restart finds them; how many were written.
    pub fn spill_host(&mut self, bytes: u64) -> usize {
        let mut newest = Vec::new();
        let mut total = 0;
        for &hash in self.host.order.values().rev() {
            let len = self.host_data[&hash].len() as u64;
            if total + len > bytes {
                break;
            }
            total += len;
            newest.push(hash);
        }
        let mut written = 0;
        for hash in newest.into_iter().rev() {
            self.host.remove(hash);
            let data = self.host_data.remove(&hash).expect("host entries have data");
            written += self.write_down(hash, data) as usize;
        }
        written
    }

    /// At shutdown: a block of the device's cache written to disk too (the device's
    /// copy goes with the process); whether it was queued (`flush` waits for it).
    pub fn persist(&mut self, hash: BlockHash, data: Vec<u8>) -> bool {
        self.write_down(hash, Arc::new(data))
    }

    /// Drops `hash` from the tiers: the device holds it again.
    pub fn forget(&mut self, hash: BlockHash) {
        let held = if self.host.remove(hash) {
            self.host_data.remove(&hash);
            true
        } else {
            self.disk.as_mut().is_some_and(|d| d.lru.contains(hash) && d.remove(hash))
        };
        if held {
            self.events.removed.push(hash);
        }
    }

    /// Writes a block to disk, the oldest there making room; whether it was (queued to
    /// be) written: without a disk tier, or too big for it, it is dropped.
    fn write_down(&mut self, hash: BlockHash, data: Arc<Vec<u8>>) -> bool {
        let bytes = data.len() as u64;
        let Some(disk) = self.disk.as_mut().filter(|d| bytes <= d.capacity) else {
            self.stats.dropped_blocks += 1;
            self.events.removed.push(hash);
            return false;
        };
        for dropped in disk.make_room(bytes) {
            self.stats.dropped_blocks += 1;
            self.events.removed.push(dropped);
        }
        disk.write(hash, data);
        self.events.stored.push((hash, Tier::Disk));
        true
    }

    /// Drops the blocks whose files could not be written: they are computed again.
    fn drop_failed_writes(&mut self) {
        let Some(disk) = self.disk.as_mut() else { return };
        for hash in disk.take_failed() {
            self.stats.disk_errors += 1;
            if disk.lru.remove(hash) {
                disk.drop_ahead(hash);
                self.events.removed.push(hash);
            }
        }
    }

    /// Waits until the disk tier's files are all written (at shutdown, and in tests).
    pub fn flush(&mut self) {
        if let Some(disk) = &self.disk {
            disk.writer.flush();
        }
        self.drop_failed_writes();
    }
}

/// The format of a block file: this, the identity's digest, the block's hash, the
/// data's length and CRC-32, the data.
const MAGIC: &[u8; 8] = b"TSKVBLK2";
const HEADER: usize = 8 + 32 + 8 + 8 + 4;

/// A block file's header.
struct Header {
    identity: [u8; 32],
    hash: BlockHash,
    len: u64,
    crc: u32,
}

impl Header {
    fn bytes(&self) -> [u8; HEADER] {
        let mut out = [0u8; HEADER];
        out[..8].copy_from_slice(MAGIC);
        out[8..40].copy_from_slice(&self.identity);
        out[40..48].copy_from_slice(&self.hash.to_le_bytes());
        out[48..56].copy_from_slice(&self.len.to_le_bytes());
        out[56..].copy_from_slice(&self.crc.to_le_bytes());
        out
    }

    /// The header at the start of `file`, if it is one.
    fn read(file: &mut std::fs::File) -> Option<Self> {
        let mut b = [0u8; HEADER];
        file.read_exact(&mut b).ok()?;
        (&b[..8] == MAGIC).then(|| Header {
            identity: b[8..40].try_into().expect("32 bytes"),
            hash: u64::from_le_bytes(b[40..48].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(b[48..56].try_into().expect("8 bytes")),
            crc: u32::from_le_bytes(b[56..].try_into().expect("4 bytes")),
        })
    }
}

/// Evicted blocks as files, one a block, in a folder of this identity's own. The files
/// are written and removed on a thread of their own (`Writer`), in order: an engine step
/// never waits on the disk for a block going down, whose bytes are served from memory
/// until its file is whole.
struct DiskTier {
    folder: PathBuf,
    identity: [u8; 32],
    capacity: u64,
    lru: Lru,
    writer: Writer,
    reader: Reader,
    /// Blocks asked of `reader`, kept until taken or gone from the tier, within
    /// `READ_AHEAD_BYTES`.
    ahead: HashMap<BlockHash, ReadAhead>,
    ahead_bytes: u64,
    /// `READ_AHEAD_BYTES` unless set (`KvTiers::set_read_ahead`).
    ahead_limit: u64,
    /// Admission passes so far (`KvTiers::start_pass`).
    passes: u64,
    tickets: u64,
}

/// Where a block on disk stands for a prompt that wants it.
enum Readiness {
    /// In memory.
    Ready,
    /// Asked of the reader, not in yet.
    Asked,
    /// Not asked: the read-ahead is full (or its reader gone); read when taken.
    NoRoom,
}

/// A block asked of the disk tier's reader.
struct ReadAhead {
    /// Which request: a block dropped and asked for again takes only the newer answer.
    ticket: u64,
    bytes: u64,
    /// Its result, once in.
    read: Option<std::io::Result<Arc<Vec<u8>>>>,
    /// The admission pass that last wanted it.
    wanted: u64,
}

/// The most bytes of blocks read ahead at once; a block past it is read when taken, in
/// the step, as it would be without a reader.
const READ_AHEAD_BYTES: u64 = 1 << 30;

/// The disk tier's file work, in the order it was asked for.
enum FileOp {
    Write {
        hash: BlockHash,
        path: PathBuf,
        identity: [u8; 32],
        data: Arc<Vec<u8>>,
    },
    Remove(PathBuf),
    /// Answered once everything before it is done.
    Flush(std::sync::mpsc::SyncSender<()>),
}

/// The thread that does a disk tier's file work, and what it has not finished.
struct Writer {
    ops: Option<std::sync::mpsc::Sender<FileOp>>,
    /// Blocks whose files are queued or being written: reads take their bytes from here.
    pending: Arc<Mutex<HashMap<BlockHash, Arc<Vec<u8>>>>>,
    /// Blocks whose files could not be written, not yet dropped from the tier.
    failed: Arc<Mutex<Vec<BlockHash>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start() -> std::io::Result<Self> {
        let (ops, queue) = std::sync::mpsc::channel::<FileOp>();
        let pending: Arc<Mutex<HashMap<BlockHash, Arc<Vec<u8>>>>> = Arc::default();
        let failed: Arc<Mutex<Vec<BlockHash>>> = Arc::default();
        let (p, f) = (pending.clone(), failed.clone());
        let thread = std::thread::Builder::new().name("kv-disk".into()).spawn(move || {
            for op in queue {
                match op {
                    FileOp::Write { hash, path, identity, data } => {
                        if let Err(e) = write_file(&path, hash, identity, &data) {
                            tracing::warn!("KV block {hash:016x} could not be written to disk: {e}");
                            f.lock().unwrap_or_else(|e| e.into_inner()).push(hash);
                        }
                        // From now on its file serves it (unless a newer copy is queued).
                        let mut pending = p.lock().unwrap_or_else(|e| e.into_inner());
                        if pending.get(&hash).is_some_and(|queued| Arc::ptr_eq(queued, &data)) {
                            pending.remove(&hash);
                        }
                    }
                    FileOp::Remove(path) => {
                        if let Err(e) = std::fs::remove_file(&path) {
                            tracing::debug!("removing KV block file {}: {e}", path.display());
                        }
                    }
                    FileOp::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })?;
        Ok(Self { ops: Some(ops), pending, failed, thread: Some(thread) })
    }

    fn send(&self, op: FileOp) {
        if let Some(ops) = &self.ops {
            // The thread lives as long as the tier: a send fails only if it panicked.
            let _ = ops.send(op);
        }
    }

    /// Waits until every file operation asked for so far is done.
    fn flush(&self) {
        let (done, wait) = std::sync::mpsc::sync_channel(1);
        self.send(FileOp::Flush(done));
        let _ = wait.recv();
    }
}

impl Drop for Writer {
    /// Finishes the work queued (a restart must find the files whole), then ends.
    fn drop(&mut self) {
        self.ops = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The thread that reads block files ahead of their steps: a request is a ticket, the
/// block and its file; each answer comes back with its ticket.
struct Reader {
    requests: Option<std::sync::mpsc::Sender<(u64, BlockHash, PathBuf)>>,
    answers: std::sync::mpsc::Receiver<(u64, BlockHash, std::io::Result<Vec<u8>>)>,
    /// Set when the tier closes: reads still queued are not done.
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reader {
    fn start(identity: [u8; 32]) -> std::io::Result<Self> {
        let (requests, queue) = std::sync::mpsc::channel::<(u64, BlockHash, PathBuf)>();
        let (answer, answers) = std::sync::mpsc::channel();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new().name("kv-disk-read".into()).spawn(move || {
            for (ticket, hash, path) in queue {
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                if answer.send((ticket, hash, read_file(&path, hash, &identity))).is_err() {
                    return;
                }
            }
        })?;
        Ok(Self { requests: Some(requests), answers, stop, thread: Some(thread) })
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.requests = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A block's data from its file, checked against its header (this identity, this
/// hash, its length and CRC).
fn read_file(path: &Path, hash: BlockHash, identity: &[u8; 32]) -> std::io::Result<Vec<u8>> {
    let mut file = std::fs::File::open(path)?;
    let header = Header::read(&mut file).ok_or_else(|| std::io::Error::other("no block header"))?;
    if &header.identity != identity || header.hash != hash {
        return Err(std::io::Error::other("the file is another block's or another model's"));
    }
    let mut data = Vec::with_capacity(header.len as usize);
    file.take(header.len + 1).read_to_end(&mut data)?;
    if data.len() as u64 != header.len || crc32fast::hash(&data) != header.crc {
        return Err(std::io::Error::other("the block's data is not what was written"));
    }
    Ok(data)
}

/// Writes a block whole under a temporary name and renames it: a file of the block's
/// name is always whole (a cut-short one is left under the temporary name, and removed).
fn write_file(path: &Path, hash: BlockHash, identity: [u8; 32], data: &[u8]) -> std::io::Result<()> {
    let partial = path.with_extension("partial");
    let header = Header { identity, hash, len: data.len() as u64, crc: crc32fast::hash(data) };
    let written = std::fs::File::create(&partial).and_then(|mut file| {
        file.write_all(&header.bytes())?;
        file.write_all(data)
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&partial, path)) {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    Ok(())
}

impl DiskTier {
    /// The folder for `identity` under `root`, and the blocks already in it (oldest by
    /// modification time first). Files that are not whole blocks of this identity are
    /// removed, and so are the folders of other identities (earlier weights: `root` is
    /// one worker's).
    fn open(root: &Path, capacity: u64, identity: &str) -> std::io::Result<Self> {
        let digest: [u8; 32] = Sha256::digest(identity.as_bytes()).into();
        let name = hex(&digest[..16]);
        let folder = root.join(&name);
        std::fs::create_dir_all(&folder)?;
        for entry in std::fs::read_dir(root)?.flatten() {
            let stale = entry.file_name().to_str().is_some_and(|n| n != name && n.len() == 32 && hex_only(n));
            if stale && let Err(e) = std::fs::remove_dir_all(entry.path()) {
                tracing::warn!("removing an earlier model's KV blocks at {}: {e}", entry.path().display());
            }
        }
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&folder)?.flatten() {
            let path = entry.path();
            let modified = entry.metadata().and_then(|m| m.modified());
            match (whole(&path, &digest), modified) {
                (Some((hash, bytes)), Ok(modified)) => found.push((modified, hash, bytes)),
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        found.sort();
        let mut tier = Self {
            folder,
            identity: digest,
            capacity,
            lru: Lru::default(),
            writer: Writer::start()?,
            reader: Reader::start(digest)?,
            ahead: HashMap::new(),
            ahead_bytes: 0,
            ahead_limit: READ_AHEAD_BYTES,
            passes: 0,
            tickets: 0,
        };
        for (_, hash, bytes) in found {
            tier.lru.insert(hash, bytes);
        }
        tier.make_room(0);
        Ok(tier)
    }

    /// Removes the oldest blocks until `bytes` more fit; the blocks removed.
    fn make_room(&mut self, bytes: u64) -> Vec<BlockHash> {
        let mut removed = Vec::new();
        while self.lru.bytes + bytes > self.capacity {
            let Some(oldest) = self.lru.oldest() else { break };
            self.remove(oldest);
            removed.push(oldest);
        }
        removed
    }

    fn path(&self, hash: BlockHash) -> PathBuf {
        self.folder.join(format!("{hash:016x}.kv"))
    }

    /// Queues a block's file (`Writer`); from now on the tier holds it.
    fn write(&mut self, hash: BlockHash, data: Arc<Vec<u8>>) {
        self.lru.insert(hash, data.len() as u64);
        self.writer.pending.lock().unwrap_or_else(|e| e.into_inner()).insert(hash, data.clone());
        self.writer.send(FileOp::Write { hash, path: self.path(hash), identity: self.identity, data });
    }

    /// A block's data: from memory while its file is being written, else as read ahead,
    /// else from its file now (`read_file`).
    fn read(&mut self, hash: BlockHash) -> std::io::Result<Arc<Vec<u8>>> {
        let ahead = self.drop_ahead(hash);
        if let Some(data) = self.writer.pending.lock().unwrap_or_else(|e| e.into_inner()).get(&hash) {
            return Ok(data.clone());
        }
        match ahead {
            Some(read) => read,
            None => read_file(&self.path(hash), hash, &self.identity).map(Arc::new),
        }
    }

    /// Whether a held block's bytes are in memory: being written, or read ahead. If not,
    /// it is asked of the reader, and made the tier's newest (the prompt that wants it,
    /// of `wanted`, is about to), unless the read-ahead has no room even so (or no
    /// reader): then it is read when taken.
    fn ready(&mut self, hash: BlockHash, wanted: &HashSet<BlockHash>) -> Readiness {
        if let Some(ahead) = self.ahead.get_mut(&hash) {
            ahead.wanted = self.passes;
            return if ahead.read.is_some() { Readiness::Ready } else { Readiness::Asked };
        }
        if self.writer.pending.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&hash) {
            return Readiness::Ready;
        }
        let Some(&(_, bytes)) = self.lru.entries.get(&hash) else { return Readiness::Ready };
        if self.reader.requests.is_none() || !self.ahead_room(bytes, wanted) {
            return Readiness::NoRoom;
        }
        self.tickets += 1;
        let request = (self.tickets, hash, self.path(hash));
        if self.reader.requests.as_ref().is_none_or(|r| r.send(request).is_err()) {
            self.reader_gone();
            return Readiness::NoRoom;
        }
        self.lru.insert(hash, bytes);
        self.ahead.insert(hash, ReadAhead { ticket: self.tickets, bytes, read: None, wanted: self.passes });
        self.ahead_bytes += bytes;
        Readiness::Asked
    }

    /// Makes room for `bytes` more read ahead, within `READ_AHEAD_BYTES`: reads in that
    /// no prompt of this admission pass has wanted (their prompts gone, admitted
    /// otherwise, or not reached) go, oldest first, never one of `wanted` (the asking
    /// prompt's). Whether it fits: a prompt behind others never takes their blocks, so
    /// the first waiting is admitted while the later ones read theirs in the step.
    fn ahead_room(&mut self, bytes: u64, wanted: &HashSet<BlockHash>) -> bool {
        if self.ahead_bytes + bytes <= self.ahead_limit {
            return true;
        }
        let mut taken_by_none: Vec<(u64, BlockHash)> = self
            .ahead
            .iter()
            .filter(|(hash, a)| a.read.is_some() && a.wanted != self.passes && !wanted.contains(*hash))
            .map(|(&hash, a)| (a.ticket, hash))
            .collect();
        taken_by_none.sort_unstable();
        for (_, hash) in taken_by_none {
            self.drop_ahead(hash);
            if self.ahead_bytes + bytes <= self.ahead_limit {
                return true;
            }
        }
        false
    }

    /// The reader thread has ended (it panicked): reads still awaited will not come,
    /// and blocks are read when taken from now on.
    fn reader_gone(&mut self) {
        tracing::warn!("the KV disk tier's reader has stopped; blocks are read in the step");
        self.reader.requests = None;
        let waiting: Vec<BlockHash> = self.ahead.iter().filter(|(_, a)| a.read.is_none()).map(|(&h, _)| h).collect();
        for hash in waiting {
            self.drop_ahead(hash);
        }
    }

    /// Takes in the reads that have ended.
    fn poll(&mut self) {
        while let Ok(answer) = self.reader.answers.try_recv() {
            self.settle(answer);
        }
    }

    /// Waits for a read asked for to end (one that ended since the last look counts);
    /// false if none has and none is under way.
    fn wait_for_read(&mut self) -> bool {
        let awaited = |d: &Self| d.ahead.values().filter(|a| a.read.is_none()).count();
        let before = awaited(self);
        self.poll();
        let after = awaited(self);
        if after < before {
            return true;
        }
        if after == 0 {
            return false;
        }
        match self.reader.answers.recv() {
            Ok(answer) => {
                self.settle(answer);
                true
            }
            Err(_) => {
                self.reader_gone();
                false
            }
        }
    }

    /// A read's result, kept if its block is still wanted by that read (not taken, or
    /// dropped and asked for again, since).
    fn settle(&mut self, (ticket, hash, read): (u64, BlockHash, std::io::Result<Vec<u8>>)) {
        if let Some(ahead) = self.ahead.get_mut(&hash)
            && ahead.ticket == ticket
        {
            ahead.read = Some(read.map(Arc::new));
        }
    }

    /// Forgets a block's read-ahead: its result, if it came.
    fn drop_ahead(&mut self, hash: BlockHash) -> Option<std::io::Result<Arc<Vec<u8>>>> {
        let ahead = self.ahead.remove(&hash)?;
        self.ahead_bytes -= ahead.bytes;
        ahead.read
    }

    /// Blocks whose files could not be written since the last call.
    fn take_failed(&mut self) -> Vec<BlockHash> {
        std::mem::take(&mut *self.writer.failed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Removes a block's file; whether it was held.
    fn remove(&mut self, hash: BlockHash) -> bool {
        if !self.lru.remove(hash) {
            return false;
        }
        self.drop_ahead(hash);
        self.writer.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&hash);
        // After its write, if that is still queued: the queue keeps the order.
        self.writer.send(FileOp::Remove(self.path(hash)));
        true
    }
}

/// A block file's hash and data length, if it is named for its hash, of `identity` and
/// whole (its data is checked when read).
fn whole(path: &Path, identity: &[u8; 32]) -> Option<(BlockHash, u64)> {
    if path.extension().and_then(|e| e.to_str()) != Some("kv") {
        return None;
    }
    let mut file = std::fs::File::open(path).ok()?;
    let header = Header::read(&mut file)?;
    let sized = file.metadata().ok()?.len() == HEADER as u64 + header.len;
    let named = path.file_stem()?.to_str()? == format!("{:016x}", header.hash);
    (&header.identity == identity && sized && named).then_some((header.hash, header.len))
}

fn hex_only(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(hash: BlockHash, len: usize) -> Arc<Vec<u8>> {
        Arc::new((0..len).map(|i| (hash as usize * 31 + i) as u8).collect())
    }

    #[test]
    fn host_overflow_moves_the_oldest_to_disk_and_a_block_is_in_one_tier() {
        let dir = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 200, disk: Some((dir.path().into(), 250)), identity: "model-a".into() };
        let mut tiers = KvTiers::open(&config).unwrap();
        for h in 1..=3 {
            tiers.put(h, block(h, 100));
        }
        // Host holds two of 100 bytes: the first went to disk.
        assert_eq!(tiers.find(1), Some(Tier::Disk));
        assert_eq!((tiers.find(2), tiers.find(3)), (Some(Tier::Host), Some(Tier::Host)));
        assert_eq!(tiers.occupancy(), (200, 100));
        // Two more: disk holds two, and drops its oldest.
        tiers.put(4, block(4, 100));
        tiers.put(5, block(5, 100));
        assert_eq!(tiers.find(1), None, "dropped from the bottom");
        assert_eq!(tiers.blocks(), (2, 2));
        assert_eq!(tiers.stats().dropped_blocks, 1);
        // Taken up to the device, it leaves the tier; its bytes are the same.
        let (data, tier) = tiers.take(2).unwrap();
        assert_eq!((data, tier), (block(2, 100), Tier::Disk));
        assert_eq!(tiers.find(2), None);
        let (data, tier) = tiers.take(5).unwrap();
        assert_eq!((data, tier), (block(5, 100), Tier::Host));
        // Computed again on the device: forgotten here.
        tiers.forget(4);
        assert_eq!(tiers.find(4), None);
        assert_eq!(tiers.take(4), None);
        let events = tiers.take_events();
        assert!(events.stored.contains(&(1, Tier::Disk)) && events.removed.contains(&1));
    }

    #[test]
    fn the_disk_tier_survives_a_restart_for_the_same_identity_only() {
        let dir = tempfile::tempdir().unwrap();
        let disk = |identity: &str| TierConfig {
            host_bytes: 0,
            disk: Some((dir.path().into(), 10_000)),
            identity: identity.into(),
        };
        {
            let mut tiers = KvTiers::open(&disk("model-a weights-1")).unwrap();
            tiers.put(7, block(7, 300));
            tiers.put(8, block(8, 300));
            assert_eq!(tiers.find(7), Some(Tier::Disk));
        }
        let mut again = KvTiers::open(&disk("model-a weights-1")).unwrap();
        let warm = again.take_events().stored;
        assert_eq!(warm.len(), 2, "a new watcher hears of the blocks found: {warm:?}");
        assert_eq!(again.take(7), Some((block(7, 300), Tier::Disk)));
        // Other weights: nothing of the first model's is served, and its folder goes.
        let mut other = KvTiers::open(&disk("model-a weights-2")).unwrap();
        assert_eq!(other.find(8), None);
        assert_eq!(other.take(8), None);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "one identity's folder left");
    }

    #[test]
    fn files_are_written_off_the_step_and_served_from_memory_until_whole() {
        let dir = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 0, disk: Some((dir.path().into(), 10_000)), identity: "m".into() };
        let mut tiers = KvTiers::open(&config).unwrap();
        let folder = tiers.disk.as_ref().unwrap().folder.clone();
        let file = |h: u64| folder.join(format!("{h:016x}.kv"));
        for h in 1..=20 {
            tiers.put(h, block(h, 300));
        }
        // Held at once, whether or not its file is written yet, with its bytes.
        assert_eq!(tiers.take(20), Some((block(20, 300), Tier::Disk)));
        tiers.put(21, block(21, 300));
        tiers.forget(21);
        tiers.flush();
        assert!(tiers.disk.as_ref().unwrap().writer.pending.lock().unwrap().is_empty());
        assert!(file(1).exists() && file(19).exists());
        assert!(!file(20).exists() && !file(21).exists(), "a block taken or forgotten leaves no file behind");
        assert_eq!(tiers.take(1), Some((block(1, 300), Tier::Disk)), "read back from its file");
        // A file that cannot be written: the block is dropped from the tier, and said so.
        std::fs::remove_dir_all(&folder).unwrap();
        tiers.put(30, block(30, 300));
        tiers.flush();
        assert_eq!(tiers.find(30), None);
        assert_eq!(tiers.stats().disk_errors, 1);
        assert!(tiers.take_events().removed.contains(&30));
    }

    #[test]
    fn blocks_on_disk_are_read_ahead_and_served_from_memory() {
        let dir = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 0, disk: Some((dir.path().into(), 1 << 20)), identity: "m".into() };
        let mut tiers = KvTiers::open(&config).unwrap();
        for hash in [1, 2] {
            tiers.put(hash, block(hash, 64));
        }
        tiers.flush();
        // Not in memory: asked for, not ready at once.
        assert!(!tiers.ready(&[1, 2]));
        while tiers.wait_for_read() {}
        assert!(tiers.ready(&[1, 2]) && !tiers.wait_for_read());
        // Taken from memory: the files could be gone by now.
        let folder = std::fs::read_dir(dir.path()).unwrap().flatten().next().unwrap().path();
        for file in std::fs::read_dir(&folder).unwrap().flatten() {
            std::fs::remove_file(file.path()).unwrap();
        }
        assert_eq!(tiers.take(1), Some((block(1, 64), Tier::Disk)));
        // A block leaving the tier leaves its read-ahead too.
        tiers.forget(2);
        let disk = tiers.disk.as_ref().unwrap();
        assert!(disk.ahead.is_empty() && disk.ahead_bytes == 0);
        assert_eq!(tiers.take(2), None);
        assert_eq!(tiers.stats().disk_errors, 0);
        // Without a read ahead, a block is read when taken: here its file is gone.
        tiers.put(3, block(3, 64));
        tiers.flush();
        std::fs::remove_file(folder.join(format!("{:016x}.kv", 3))).unwrap();
        assert_eq!(tiers.take(3), None);
        assert_eq!(tiers.stats().disk_errors, 1);
    }

    #[test]
    fn reads_nobody_took_make_room_for_those_a_prompt_waits_for() {
        let dir = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 0, disk: Some((dir.path().into(), 1 << 20)), identity: "m".into() };
        let mut tiers = KvTiers::open(&config).unwrap();
        for hash in [1, 2, 3] {
            tiers.put(hash, block(hash, 64));
        }
        tiers.flush();
        tiers.set_read_ahead(128);
        let ahead = |t: &KvTiers| {
            let mut held: Vec<BlockHash> = t.disk.as_ref().unwrap().ahead.keys().copied().collect();
            held.sort();
            held
        };
        // Blocks 1 and 2 read for a prompt that never took them.
        assert!(!tiers.ready(&[1, 2]));
        while tiers.wait_for_read() {}
        // In the same pass, another prompt takes no room from it...
        assert!(tiers.ready(&[3]), "block 3 is read when taken");
        assert_eq!(ahead(&tiers), [1, 2]);
        // ...in the next, where that prompt is not seen again, the oldest of its blocks
        // makes room for block 3.
        tiers.start_pass();
        assert!(!tiers.ready(&[3]));
        assert_eq!(ahead(&tiers), [2, 3]);
        while tiers.wait_for_read() {}
        assert!(tiers.ready(&[3]));
        // A prompt wanting more than the read-ahead holds: none of its own blocks goes,
        // the one that does not fit is read when taken.
        tiers.start_pass();
        assert!(tiers.ready(&[1, 2, 3]));
        assert_eq!(ahead(&tiers), [2, 3]);
        for hash in [1, 2, 3] {
            assert_eq!(tiers.take(hash), Some((block(hash, 64), Tier::Disk)));
        }
        assert!(ahead(&tiers).is_empty() && tiers.disk.as_ref().unwrap().ahead_bytes == 0);
    }

    #[test]
    fn a_damaged_file_is_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let config = TierConfig { host_bytes: 0, disk: Some((dir.path().into(), 10_000)), identity: "m".into() };
        let mut tiers = KvTiers::open(&config).unwrap();
        tiers.put(9, block(9, 300));
        tiers.put(10, block(10, 300));
        tiers.flush();
        let folder = tiers.disk.as_ref().unwrap().folder.clone();
        // Cut short while running: read back, refused, and computed again.
        let f = std::fs::OpenOptions::new().write(true).open(folder.join(format!("{:016x}.kv", 9u64))).unwrap();
        f.set_len(100).unwrap();
        assert_eq!(tiers.take(9), None);
        assert_eq!(tiers.stats().disk_errors, 1);
        // A byte changed in place (a torn write the size does not show): refused too.
        tiers.put(11, block(11, 300));
        tiers.flush();
        let path = folder.join(format!("{:016x}.kv", 11u64));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[HEADER + 7] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert_eq!(tiers.take(11), None);
        assert_eq!(tiers.stats().disk_errors, 2);
        // Cut short before a restart: not indexed at all.
        let f = std::fs::OpenOptions::new().write(true).open(folder.join(format!("{:016x}.kv", 10u64))).unwrap();
        f.set_len(HEADER as u64 + 10).unwrap();
        drop(tiers);
        let again = KvTiers::open(&config).unwrap();
        assert_eq!(again.find(10), None);
    }
}
