//! **Test-only** pause points in the commit path, for tests that kill a real writer process
//! at a known step of the protocol (tests/kill.rs).
//!
//! Inert unless both environment variables are set, and read once per process:
//!
//! * [`PAUSE_ENV`] (`CKPTSTORE_TEST_PAUSE`): comma-separated names of points to stop at
//!   (see [`Point::name`]; unknown names are ignored);
//! * [`PAUSE_DIR_ENV`] (`CKPTSTORE_TEST_PAUSE_DIR`): an existing directory for the
//!   announcements.
//!
//! On reaching a listed point the writer creates the file `<dir>/<point name>` (holding its
//! process id) and then blocks that thread forever: the test waits for the file and kills
//! the process, knowing exactly where it stands. If the announcement cannot be written the
//! writer says so on stderr and carries on (a test waiting for it then times out).
//! With the variables unset a point costs one atomic load.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

/// Environment variable listing the points to stop at (test-only).
pub const PAUSE_ENV: &str = "CKPTSTORE_TEST_PAUSE";
/// Environment variable naming the directory for the announcements (test-only).
pub const PAUSE_DIR_ENV: &str = "CKPTSTORE_TEST_PAUSE_DIR";

/// A point of the commit protocol (format-spec/durability.md §Protocol) where a test may
/// stop the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Point {
    /// The writer lock is held and leftovers of earlier saves are removed; no file of this
    /// save exists yet.
    BeforeShards,
    /// Every shard is durable under its final name (step 2 done) and the new manifest is
    /// fsynced under its temporary name; the rename of step 3 is next.
    BeforeManifestRename,
    /// The manifest rename of step 3 is done; the directory fsync of step 4 is next.
    AfterManifestRename,
    /// The commit point (step 4) has passed; cleanup (step 5) is next.
    BeforeCleanup,
    /// A rank's shards are durable under their final names
    /// (`write::parts::write_part`); its part descriptor is next. Not in [`Point::ALL`],
    /// which lists the points of a single-process save.
    BeforePart,
}

impl Point {
    /// Every point of a single-process save, in protocol order.
    pub const ALL: [Point; 4] = [
        Point::BeforeShards,
        Point::BeforeManifestRename,
        Point::AfterManifestRename,
        Point::BeforeCleanup,
    ];

    /// The name used in [`PAUSE_ENV`] and for the announcement file.
    pub fn name(self) -> &'static str {
        match self {
            Point::BeforeShards => "before-shards",
            Point::BeforeManifestRename => "before-manifest-rename",
            Point::AfterManifestRename => "after-manifest-rename",
            Point::BeforeCleanup => "before-cleanup",
            Point::BeforePart => "before-part",
        }
    }
}

struct Config {
    points: Vec<String>,
    dir: PathBuf,
}

static CONFIG: OnceLock<Option<Config>> = OnceLock::new();

fn load() -> Option<Config> {
    let points = std::env::var(PAUSE_ENV).ok()?;
    let dir = std::env::var_os(PAUSE_DIR_ENV)?;
    Some(Config {
        points: points.split(',').map(|s| s.trim().to_string()).collect(),
        dir: dir.into(),
    })
}

/// Stop here if the test environment asks for `p` (see the module docs); otherwise return
/// at once.
pub(crate) fn point(p: Point) {
    let Some(cfg) = CONFIG.get_or_init(load) else {
        return;
    };
    if !cfg.points.iter().any(|n| n == p.name()) {
        return;
    }
    let marker = cfg.dir.join(p.name());
    if let Err(e) = std::fs::write(&marker, std::process::id().to_string()) {
        eprintln!(
            "ckptstore: {PAUSE_ENV}: cannot announce {} at {}: {e}; not pausing",
            p.name(),
            marker.display()
        );
        return;
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
