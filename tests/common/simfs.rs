//! An in-memory model of a POSIX file system for crash-consistency tests of the commit
//! protocol (format-spec/durability.md), plugged into the writer through
//! `ckptstore::write::fs::Fs` (`save_with_fs`, `write_part_with_fs`, `commit_with_fs`).
//!
//! The model holds one directory (the checkpoint directory; every path handed to it must be
//! `<dir>/<name>`) and a table of inodes. Per inode it records the *current* content (what
//! a reader sees while the machine is up) and the *durable* content (as of the last
//! successful `sync` of that file: assumption A2). Per directory it records the current
//! entries (name -> inode) and the durable entries (as of the last successful `sync_dir`:
//! A3), plus the directory operations issued since that `sync_dir` (`pending`), so that
//! power-loss images in which only some of them reached the disk can be built (A4).
//!
//! Every operation (create, each `write` call, sync, rename, sync_dir, remove, list, read) is
//! numbered in one global log, under a mutex: the writer runs its shards on rayon threads.
//! Faults: crash (every operation from the k-th on fails and has no effect), an errno once
//! at the k-th operation or forever from it, and a "lying" sync (the j-th sync, counting file
//! and directory syncs, reports success but makes nothing durable).
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ckptstore::write::fs::Fs;
use ckptstore::{Checkpoint, DType, Error};

/// errno values (Linux), used without a libc dependency.
pub const EIO: i32 = 5;
pub const EACCES: i32 = 13;
pub const ENOSPC: i32 = 28;

/// One file.
#[derive(Clone, Debug, Default)]
pub struct Inode {
    /// Content as of the last successful `sync` (empty if never synced).
    pub durable: Vec<u8>,
    /// Content as seen by the running system.
    pub current: Vec<u8>,
}

/// A directory operation not yet covered by a `sync_dir`, with the inode it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DirOp {
    Create {
        name: String,
        ino: usize,
    },
    Rename {
        from: String,
        to: String,
        ino: usize,
    },
    Remove {
        name: String,
        ino: usize,
    },
}

impl DirOp {
    /// Apply this operation to a set of entries (as it would reach the disk on its own).
    pub fn apply(&self, entries: &mut BTreeMap<String, usize>) {
        match self {
            DirOp::Create { name, ino } => {
                entries.insert(name.clone(), *ino);
            }
            DirOp::Rename { from, to, ino } => {
                if entries.get(from) == Some(ino) {
                    entries.remove(from);
                }
                entries.insert(to.clone(), *ino);
            }
            DirOp::Remove { name, ino } => {
                if entries.get(name) == Some(ino) {
                    entries.remove(name);
                }
            }
        }
    }
}

/// What an operation was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpKind {
    Create {
        name: String,
        ino: Option<usize>,
    },
    Write {
        name: String,
        ino: usize,
        offset: usize,
        len: usize,
    },
    Sync {
        name: String,
        ino: usize,
    },
    Rename {
        from: String,
        to: String,
    },
    SyncDir,
    Remove {
        name: String,
    },
    List,
    /// `read_prefix`: reads the current content (the commit of a multi-rank save, C2).
    Read {
        name: String,
    },
}

/// How an operation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpResult {
    Ok,
    /// The sync was the disabled one: success reported, nothing made durable.
    Lied,
    /// Failed with this message (injected crash, injected errno, or a genuine model error
    /// such as EEXIST).
    Failed(String),
}

#[derive(Clone, Debug)]
pub struct OpRecord {
    pub index: usize,
    pub kind: OpKind,
    pub result: OpResult,
    pub thread: String,
}

impl OpRecord {
    pub fn is_sync(&self) -> bool {
        matches!(self.kind, OpKind::Sync { .. } | OpKind::SyncDir)
    }
    pub fn ok(&self) -> bool {
        matches!(self.result, OpResult::Ok | OpResult::Lied)
    }
    /// A short description with checkpoint ids replaced by `<id>`.
    pub fn describe(&self) -> String {
        let s = match &self.kind {
            OpKind::Create { name, .. } => format!("create {name}"),
            OpKind::Write {
                name, offset, len, ..
            } => format!("write {name} [{offset}..+{len}]"),
            OpKind::Sync { name, .. } => format!("sync {name}"),
            OpKind::Rename { from, to } => format!("rename {from} -> {to}"),
            OpKind::SyncDir => "sync_dir".to_string(),
            OpKind::Remove { name } => format!("remove {name}"),
            OpKind::List => "list".to_string(),
            OpKind::Read { name } => format!("read {name}"),
        };
        let r = match &self.result {
            OpResult::Ok => String::new(),
            OpResult::Lied => " (disabled: no-op)".to_string(),
            OpResult::Failed(m) => format!(" (failed: {m})"),
        };
        format!("#{} {}{}", self.index, shorten_ids(&s), r)
    }
}

/// Replace every run of 32 lowercase hex digits by `<id>`.
pub fn shorten_ids(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        let run = b[i..]
            .iter()
            .take_while(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
            .count();
        if run == 32 {
            out.push_str("<id>");
            i += 32;
        } else {
            let ch = s[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// Which operations fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Fault {
    #[default]
    None,
    /// A crash after `k` operations: the k-th and every later one fails, with no effect.
    CrashFrom(usize),
    /// The k-th operation fails once with this errno, with no effect.
    ErrnoOnce(usize, i32),
    /// Every operation from the k-th on fails with this errno, with no effect.
    ErrnoFrom(usize, i32),
}

/// The whole model state; cloneable, so a base state can be reused for every crash point.
#[derive(Clone, Debug, Default)]
pub struct SimState {
    pub inodes: Vec<Inode>,
    /// Current entries of the directory.
    pub cur: BTreeMap<String, usize>,
    /// Durable entries (as of the last successful, not disabled, `sync_dir`).
    pub dur: BTreeMap<String, usize>,
    /// Directory operations since then, in order: `dur` + all of them = `cur`.
    pub pending: Vec<DirOp>,
    pub log: Vec<OpRecord>,
    pub fault: Fault,
    /// The j-th sync (0-based, file and directory syncs counted together in log order)
    /// reports success but makes nothing durable.
    pub disabled_sync: Option<usize>,
    pub syncs_seen: usize,
    /// Parallel mode (see [`Parallel`]); `None`: operations run as the writer issues them.
    pub parallel: Option<Parallel>,
    /// A full disk: a write that would bring the current bytes of the files in the
    /// directory above this many fails with ENOSPC, with no effect.
    pub capacity: Option<usize>,
}

/// Parallel mode: forces the writer's rayon threads to interleave, deterministically.
/// The `create` of each of the `n` temporary shards waits until all `n` have been called (so
/// each shard is on its own thread, and none can be skipped any more); then the operations
/// on temporary shards (create, writes, sync, rename) take turns, shard 0, 1, ..., n-1, 0,
/// ...; a shard leaves the rotation after its rename or after any failed operation (the
/// writer abandons a shard at its first error). Waits give up after 2 s (`timed_out`).
#[derive(Clone, Debug)]
pub struct Parallel {
    pub n: usize,
    pub arrivals: usize,
    pub turn: Option<usize>,
    pub done: Vec<bool>,
    pub timed_out: bool,
}

impl Parallel {
    pub fn new(n: usize) -> Self {
        Parallel {
            n,
            arrivals: 0,
            turn: Some(0),
            done: vec![false; n],
            timed_out: false,
        }
    }
}

/// The shard index of a temporary shard name, `.ckpt-tmp-shard-<id>-<index>.safetensors`.
pub fn temp_shard_index(name: &str) -> Option<usize> {
    let rest = name
        .strip_prefix(".ckpt-tmp-shard-")?
        .strip_suffix(".safetensors")?;
    rest.rsplit('-').next()?.parse().ok()
}

impl SimState {
    /// Make everything durable and forget the log: a settled directory (e.g. an old
    /// checkpoint written long ago).
    pub fn settle(&mut self) {
        for i in &mut self.inodes {
            i.durable = i.current.clone();
        }
        self.dur = self.cur.clone();
        self.pending.clear();
        self.log.clear();
        self.syncs_seen = 0;
        self.fault = Fault::None;
        self.disabled_sync = None;
        self.parallel = None;
    }

    /// Add a file directly (durable), outside the log.
    pub fn add_durable_file(&mut self, name: &str, content: &[u8]) {
        let ino = self.inodes.len();
        self.inodes.push(Inode {
            durable: content.to_vec(),
            current: content.to_vec(),
        });
        self.cur.insert(name.to_string(), ino);
        self.dur.insert(name.to_string(), ino);
    }

    /// Current bytes of the files in the directory.
    pub fn used(&self) -> usize {
        self.cur
            .values()
            .map(|&i| self.inodes[i].current.len())
            .sum()
    }

    /// Check `dur` + `pending` = `cur`.
    pub fn check_invariant(&self) {
        let mut e = self.dur.clone();
        for op in &self.pending {
            op.apply(&mut e);
        }
        assert_eq!(
            e, self.cur,
            "model bug: durable entries + pending ops != current entries"
        );
    }

    /// Start operation `kind`: log it and decide whether it fails.
    fn begin(&mut self, kind: OpKind) -> (usize, Option<io::Error>) {
        let index = self.log.len();
        let err = match self.fault {
            Fault::CrashFrom(k) if index >= k => Some(io::Error::other("simulated crash")),
            Fault::ErrnoOnce(k, e) if index == k => Some(io::Error::from_raw_os_error(e)),
            Fault::ErrnoFrom(k, e) if index >= k => Some(io::Error::from_raw_os_error(e)),
            _ => None,
        };
        let result = match &err {
            Some(e) => OpResult::Failed(e.to_string()),
            None => OpResult::Ok,
        };
        self.log.push(OpRecord {
            index,
            kind,
            result,
            thread: format!("{:?}", std::thread::current().id()),
        });
        (index, err)
    }

    fn fail(&mut self, index: usize, e: io::Error) -> io::Error {
        self.log[index].result = OpResult::Failed(e.to_string());
        e
    }

    /// A sync: returns whether it really makes things durable (false for the disabled one).
    fn sync_is_real(&mut self, index: usize) -> bool {
        let j = self.syncs_seen;
        self.syncs_seen += 1;
        if self.disabled_sync == Some(j) {
            self.log[index].result = OpResult::Lied;
            false
        } else {
            true
        }
    }

    /// The inode of the most recent successful write, if any.
    pub fn last_written(&self) -> Option<usize> {
        self.log
            .iter()
            .rev()
            .find_map(|r| match (&r.kind, &r.result) {
                (OpKind::Write { ino, .. }, OpResult::Ok) => Some(*ino),
                _ => None,
            })
    }
}

/// The model's shared state: the mutex-protected `SimState` and a condition variable for
/// parallel mode.
pub struct Shared {
    state: Mutex<SimState>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// In parallel mode, wait until it is temporary shard `shard`'s turn.
    fn wait_turn<'a>(
        &'a self,
        mut st: MutexGuard<'a, SimState>,
        shard: Option<usize>,
    ) -> MutexGuard<'a, SimState> {
        let Some(i) = shard else { return st };
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let Some(p) = &mut st.parallel else { return st };
            if p.turn == Some(i) || p.timed_out {
                return st;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                p.timed_out = true;
                return st;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// In parallel mode, after an operation of temporary shard `shard`: leave the rotation
    /// if `finished`, and pass the turn on.
    fn pass_turn(&self, st: &mut SimState, shard: Option<usize>, finished: bool) {
        let (Some(i), Some(p)) = (shard, &mut st.parallel) else {
            return;
        };
        if i >= p.n {
            return;
        }
        if finished {
            p.done[i] = true;
        }
        p.turn = (1..=p.n).map(|d| (i + d) % p.n).find(|&j| !p.done[j]);
        self.cv.notify_all();
    }
}

/// The model, as a `Fs`. Cheap to clone (shared state).
#[derive(Clone)]
pub struct SimFs {
    pub shared: Arc<Shared>,
    pub dir: PathBuf,
}

impl SimFs {
    pub fn new(dir: &Path, state: SimState) -> Self {
        SimFs {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                cv: Condvar::new(),
            }),
            dir: dir.to_path_buf(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, SimState> {
        self.shared.lock()
    }

    pub fn snapshot(&self) -> SimState {
        self.lock().clone()
    }

    fn name(&self, p: &Path) -> String {
        assert_eq!(
            p.parent(),
            Some(self.dir.as_path()),
            "SimFs models one directory; got {}",
            p.display()
        );
        p.file_name().unwrap().to_str().unwrap().to_string()
    }
}

/// A file open for writing in the model.
pub struct SimFile {
    shared: Arc<Shared>,
    ino: usize,
    name: String,
    pos: usize,
    shard: Option<usize>,
}

impl Write for SimFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let st = self.shared.lock();
        let mut st = self.shared.wait_turn(st, self.shard);
        let (_, err) = st.begin(OpKind::Write {
            name: self.name.clone(),
            ino: self.ino,
            offset: self.pos,
            len: buf.len(),
        });
        if let Some(e) = err {
            self.shared.pass_turn(&mut st, self.shard, true);
            return Err(e);
        }
        let grow = (self.pos + buf.len()).saturating_sub(st.inodes[self.ino].current.len());
        if st.capacity.is_some_and(|c| st.used() + grow > c) {
            let index = st.log.len() - 1;
            let e = st.fail(index, io::Error::from_raw_os_error(ENOSPC));
            self.shared.pass_turn(&mut st, self.shard, true);
            return Err(e);
        }
        let cur = &mut st.inodes[self.ino].current;
        let end = self.pos + buf.len();
        if cur.len() < end {
            cur.resize(end, 0);
        }
        cur[self.pos..end].copy_from_slice(buf);
        self.pos = end;
        self.shared.pass_turn(&mut st, self.shard, false);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl SimFs {
    fn create_locked(st: &mut SimState, name: &str) -> io::Result<usize> {
        let (index, err) = st.begin(OpKind::Create {
            name: name.to_string(),
            ino: None,
        });
        if let Some(e) = err {
            return Err(e);
        }
        if st.cur.contains_key(name) {
            return Err(st.fail(index, io::Error::from(io::ErrorKind::AlreadyExists)));
        }
        let ino = st.inodes.len();
        st.inodes.push(Inode::default());
        st.cur.insert(name.to_string(), ino);
        st.pending.push(DirOp::Create {
            name: name.to_string(),
            ino,
        });
        st.log[index].kind = OpKind::Create {
            name: name.to_string(),
            ino: Some(ino),
        };
        Ok(ino)
    }

    fn rename_locked(st: &mut SimState, f: String, t: String) -> io::Result<()> {
        let (index, err) = st.begin(OpKind::Rename {
            from: f.clone(),
            to: t.clone(),
        });
        if let Some(e) = err {
            return Err(e);
        }
        let Some(ino) = st.cur.remove(&f) else {
            return Err(st.fail(index, io::Error::from(io::ErrorKind::NotFound)));
        };
        st.cur.insert(t.clone(), ino);
        st.pending.push(DirOp::Rename {
            from: f,
            to: t,
            ino,
        });
        Ok(())
    }
}

impl Fs for SimFs {
    type File = SimFile;

    fn create(&self, path: &Path) -> io::Result<SimFile> {
        let name = self.name(path);
        let shard = temp_shard_index(&name);
        let mut st = self.lock();
        if let (Some(_), Some(p)) = (shard, &mut st.parallel) {
            p.arrivals += 1;
            self.shared.cv.notify_all();
            let deadline = Instant::now() + Duration::from_secs(2);
            loop {
                let p = st.parallel.as_mut().unwrap();
                if p.arrivals >= p.n || p.timed_out {
                    break;
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    p.timed_out = true;
                    break;
                }
                st = self
                    .shared
                    .cv
                    .wait_timeout(st, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let mut st = self.shared.wait_turn(st, shard);
        let r = Self::create_locked(&mut st, &name);
        self.shared.pass_turn(&mut st, shard, r.is_err());
        let ino = r?;
        Ok(SimFile {
            shared: self.shared.clone(),
            ino,
            name,
            pos: 0,
            shard,
        })
    }

    fn sync(&self, file: &mut SimFile, _path: &Path) -> io::Result<()> {
        let st = self.lock();
        let mut st = self.shared.wait_turn(st, file.shard);
        let (index, err) = st.begin(OpKind::Sync {
            name: file.name.clone(),
            ino: file.ino,
        });
        if let Some(e) = err {
            self.shared.pass_turn(&mut st, file.shard, true);
            return Err(e);
        }
        if st.sync_is_real(index) {
            let i = &mut st.inodes[file.ino];
            i.durable = i.current.clone();
        }
        self.shared.pass_turn(&mut st, file.shard, false);
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (f, t) = (self.name(from), self.name(to));
        let shard = temp_shard_index(&f);
        let st = self.lock();
        let mut st = self.shared.wait_turn(st, shard);
        let r = Self::rename_locked(&mut st, f, t);
        self.shared.pass_turn(&mut st, shard, true);
        r
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        assert_eq!(dir, self.dir.as_path());
        let mut st = self.lock();
        let (index, err) = st.begin(OpKind::SyncDir);
        if let Some(e) = err {
            return Err(e);
        }
        if st.sync_is_real(index) {
            st.dur = st.cur.clone();
            st.pending.clear();
        }
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let name = self.name(path);
        let mut st = self.lock();
        let (index, err) = st.begin(OpKind::Remove { name: name.clone() });
        if let Some(e) = err {
            return Err(e);
        }
        let Some(ino) = st.cur.remove(&name) else {
            return Err(st.fail(index, io::Error::from(io::ErrorKind::NotFound)));
        };
        st.pending.push(DirOp::Remove { name, ino });
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        assert_eq!(dir, self.dir.as_path());
        let mut st = self.lock();
        let (_, err) = st.begin(OpKind::List);
        if let Some(e) = err {
            return Err(e);
        }
        Ok(st.cur.keys().cloned().collect())
    }

    fn read_prefix(&self, path: &Path, max: u64) -> io::Result<(u64, Vec<u8>)> {
        let name = self.name(path);
        let mut st = self.lock();
        let (index, err) = st.begin(OpKind::Read { name: name.clone() });
        if let Some(e) = err {
            return Err(e);
        }
        let Some(&ino) = st.cur.get(&name) else {
            return Err(st.fail(index, io::Error::from(io::ErrorKind::NotFound)));
        };
        let cur = &st.inodes[ino].current;
        let n = usize::try_from(max).unwrap_or(usize::MAX).min(cur.len());
        Ok((cur.len() as u64, cur[..n].to_vec()))
    }
}

// ---------------------------------------------------------------------------------------
// Power-loss images.

/// The files of a directory after a (simulated) reboot: name -> content.
pub type Image = BTreeMap<String, Vec<u8>>;

fn image_of(entries: &BTreeMap<String, usize>, content: &dyn Fn(usize) -> Vec<u8>) -> Image {
    entries
        .iter()
        .map(|(n, &ino)| (n.clone(), content(ino)))
        .collect()
}

/// Every image this test suite considers for a state (see the module docs of crash_sim.rs
/// for the variants), as (variant name, image). Images may repeat; callers dedupe.
/// `full` = false gives only A (current state) and B+D (durable state).
pub fn images(st: &SimState, full: bool) -> Vec<(String, Image)> {
    let cur = |ino: usize| st.inodes[ino].current.clone();
    let dur = |ino: usize| st.inodes[ino].durable.clone();
    let mut out = vec![("A current".to_string(), image_of(&st.cur, &cur))];
    if !full {
        out.push(("B+D durable".to_string(), image_of(&st.dur, &dur)));
        return out;
    }
    out.push(("B data-unsynced-dropped".into(), image_of(&st.cur, &dur)));
    // C: the file of the most recent write keeps its durable content plus a prefix of its
    // unsynced bytes, cut at the last 512- or 4096-byte boundary before its current end.
    // (block, inode, its torn content); files only grow, so durable is a prefix of current.
    let mut torn: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    if let Some(w) = st.last_written() {
        let node = &st.inodes[w];
        let (d, c) = (node.durable.len(), node.current.len());
        for block in [512usize, 4096] {
            let cut = c.saturating_sub(1) / block * block;
            if c > 0 && cut > d {
                let mut v = node.durable.clone();
                v.extend_from_slice(&node.current[d..cut]);
                torn.push((block, w, v));
            }
        }
    }
    let torn_content = |w: usize, bytes: &[u8]| {
        let bytes = bytes.to_vec();
        move |ino: usize| {
            if ino == w {
                bytes.clone()
            } else {
                st.inodes[ino].durable.clone()
            }
        }
    };
    for (block, w, bytes) in &torn {
        out.push((
            format!("C{block} torn-last-write"),
            image_of(&st.cur, &torn_content(*w, bytes)),
        ));
    }
    out.push(("D dir-ops-lost".into(), image_of(&st.dur, &cur)));
    out.push(("B+D".into(), image_of(&st.dur, &dur)));
    for (block, w, bytes) in &torn {
        out.push((
            format!("C{block}+D"),
            image_of(&st.dur, &torn_content(*w, bytes)),
        ));
    }
    // E: only some of the directory operations not covered by a sync_dir reached the disk
    // (A4: in any order), file content per B.
    let n = st.pending.len();
    if n >= 2 {
        for p in 1..n {
            let mut e = st.dur.clone();
            for op in &st.pending[..p] {
                op.apply(&mut e);
            }
            out.push((format!("E-prefix {p}/{n}"), image_of(&e, &dur)));
        }
        for i in 0..n {
            let mut e = st.dur.clone();
            st.pending[i].apply(&mut e);
            out.push((format!("E-only {}/{n}", i + 1), image_of(&e, &dur)));
            let mut e = st.dur.clone();
            for (j, op) in st.pending.iter().enumerate() {
                if j != i {
                    op.apply(&mut e);
                }
            }
            out.push((format!("E-all-but {}/{n}", i + 1), image_of(&e, &dur)));
        }
    }
    out
}

/// Write an image into a fresh real directory `path`.
pub fn materialize(img: &Image, path: &Path) {
    let _ = std::fs::remove_dir_all(path);
    std::fs::create_dir_all(path).unwrap();
    for (name, bytes) in img {
        std::fs::write(path.join(name), bytes).unwrap();
    }
}

/// A short listing of an image for failure messages.
pub fn describe_image(img: &Image) -> String {
    img.iter()
        .map(|(n, b)| format!("{} ({} B)", shorten_ids(n), b.len()))
        .collect::<Vec<_>>()
        .join(", ")
}

// ---------------------------------------------------------------------------------------
// What a checkpoint must hold.

/// The expected content of a checkpoint.
#[derive(Clone, Debug)]
pub struct Expected {
    pub label: &'static str,
    pub tensors: Vec<(String, DType, Vec<u64>, Vec<u8>)>,
    pub metadata: serde_json::Value,
}

/// What `Checkpoint::open` + `verify` made of a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// `Error::NotFound`: no checkpoint.
    NotFound,
    /// Opened, verified, and equal to this expected checkpoint (its label); the id.
    Is(&'static str, String),
    /// Anything else: the error or the difference.
    Bad(String),
}

impl Seen {
    pub fn label(&self) -> &str {
        match self {
            Seen::NotFound => "NotFound",
            Seen::Is(l, _) => l,
            Seen::Bad(_) => "damaged",
        }
    }
}

/// Open and verify `dir`; compare it with each candidate.
pub fn classify(dir: &Path, candidates: &[&Expected]) -> Seen {
    let ck = match Checkpoint::open(dir) {
        Ok(ck) => ck,
        Err(Error::NotFound { .. }) => return Seen::NotFound,
        Err(e) => return Seen::Bad(format!("open failed: {e}")),
    };
    if let Err(e) = ck.verify() {
        return Seen::Bad(format!("verify failed: {e}"));
    }
    let id = ck
        .manifest()
        .map(|m| m.checkpoint_id.clone())
        .unwrap_or_default();
    let mut diffs = Vec::new();
    for c in candidates {
        match diff(&ck, c) {
            None => return Seen::Is(c.label, id),
            Some(d) => diffs.push(format!("not {}: {d}", c.label)),
        }
    }
    Seen::Bad(format!("opened and verified, but {}", diffs.join("; ")))
}

fn diff(ck: &Checkpoint, e: &Expected) -> Option<String> {
    if ck.metadata() != &e.metadata {
        return Some(format!("metadata {} != {}", ck.metadata(), e.metadata));
    }
    if ck.catalog().two_level() {
        return diff_two_level(ck, e);
    }
    let names: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
    let want: Vec<&str> = e.tensors.iter().map(|t| t.0.as_str()).collect();
    if names != want {
        return Some(format!("tensors {names:?} != {want:?}"));
    }
    for (name, dtype, shape, bytes) in &e.tensors {
        let v = ck.read(name).view_unchecked().unwrap();
        if v.dtype() != *dtype || v.shape() != &shape[..] || v.bytes() != &bytes[..] {
            return Some(format!("tensor {name:?} differs"));
        }
    }
    None
}

/// [`diff`] of a two-level checkpoint, whose chunk tensors live in its parts: every stored
/// tensor (the root's, and every chunk and replica of every part) by name, dtype and shape;
/// the bytes of the root's tensors and of every chunk reads use (replicas were checked
/// against their CRCs by `verify`, and the commit checked those equal the chunk's).
fn diff_two_level(ck: &Checkpoint, e: &Expected) -> Option<String> {
    type Stored = (String, ckptstore::DType, Vec<u64>, Option<Vec<u8>>);
    let mut got: Vec<Stored> = Vec::new();
    for t in ck.tensors() {
        let v = ck.read(&t.name).view_unchecked().ok()?;
        got.push((
            t.name.clone(),
            t.dtype,
            t.shape.clone(),
            Some(v.bytes().to_vec()),
        ));
    }
    for g in ck.catalog().globals() {
        let chunks = match ck.catalog().stored_chunks(&g.name) {
            Ok(c) => c,
            Err(err) => return Some(format!("chunks of {:?}: {err}", g.name)),
        };
        for c in chunks {
            let bytes = if c.replica {
                None
            } else {
                match ck
                    .read(&g.name)
                    .region(&c.region.offsets, &c.region.shape)
                    .to_tensor()
                {
                    Ok(t) => Some(t.bytes().to_vec()),
                    Err(err) => return Some(format!("region of {:?}: {err}", g.name)),
                }
            };
            got.push((
                c.tensor.name.clone(),
                c.tensor.dtype,
                c.tensor.shape.clone(),
                bytes,
            ));
        }
    }
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want: Vec<&(String, ckptstore::DType, Vec<u64>, Vec<u8>)> = e.tensors.iter().collect();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<&str> = got.iter().map(|t| t.0.as_str()).collect();
    let wnames: Vec<&str> = want.iter().map(|t| t.0.as_str()).collect();
    if names != wnames {
        return Some(format!("tensors {names:?} != {wnames:?}"));
    }
    for (g, w) in got.iter().zip(want) {
        if g.1 != w.1 || g.2 != w.2 || g.3.as_ref().is_some_and(|b| b != &w.3) {
            return Some(format!("tensor {:?} differs", g.0));
        }
    }
    None
}

/// Evaluate images with a cache (identical images are opened once).
pub struct Evaluator {
    pub root: tempfile::TempDir,
    cache: HashMap<Image, Seen>,
    pub distinct: usize,
    pub cases: usize,
    /// Cases per variant (the variant name up to its first space).
    pub by_variant: BTreeMap<String, usize>,
}

impl Default for Evaluator {
    fn default() -> Self {
        Self::new()
    }
}

impl Evaluator {
    pub fn new() -> Self {
        Evaluator {
            root: tempfile::tempdir().unwrap(),
            cache: HashMap::new(),
            distinct: 0,
            cases: 0,
            by_variant: BTreeMap::new(),
        }
    }

    /// Forget cached results (images of a new save never repeat those of an earlier one:
    /// every save draws a new random id).
    pub fn clear(&mut self) {
        self.cache.clear();
    }

    pub fn eval(&mut self, variant: &str, img: &Image, candidates: &[&Expected]) -> Seen {
        self.cases += 1;
        let cat = variant.split(' ').next().unwrap_or(variant).to_string();
        *self.by_variant.entry(cat).or_default() += 1;
        if let Some(s) = self.cache.get(img) {
            return s.clone();
        }
        self.distinct += 1;
        let p = self.root.path().join("img");
        materialize(img, &p);
        let s = classify(&p, candidates);
        self.cache.insert(img.clone(), s.clone());
        s
    }
}
