//! A real S3 server for tests: `s3s-fs` (a Rust S3 implementation over a directory) on a
//! free loopback port with a temporary data directory (a bucket is a directory), killed
//! when dropped. The tests FAIL, saying how to install it, when the binary is absent: CI
//! installs it (scripts/test.sh); `cargo install s3s-fs@0.14.1 --locked --features binary`.
#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ckptstore::store::s3::S3Config;

pub const ACCESS_KEY: &str = "ckpttestkey";
pub const SECRET_KEY: &str = "ckpttestsecret0123456789";

/// The s3s-fs binary: `$CKPT_S3S_FS`, else `s3s-fs` on PATH, else `~/.cargo/bin/s3s-fs`.
pub fn s3s_fs_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("CKPT_S3S_FS") {
        return p.into();
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let p = d.join("s3s-fs");
            if p.is_file() {
                return p;
            }
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        let p = Path::new(&home).join(".cargo/bin/s3s-fs");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "the S3 tests need the s3s-fs server and it is not installed: run \
         `cargo install s3s-fs@0.14.1 --locked --features binary` (scripts/test.sh does), \
         or point CKPT_S3S_FS at the binary"
    );
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local addr").port()
}

/// A running s3s-fs.
pub struct S3Server {
    child: Option<Child>,
    pub port: u16,
    data: tempfile::TempDir,
}

impl S3Server {
    /// Start a server with one bucket, `bucket`.
    pub fn start(bucket: &str) -> S3Server {
        let data = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir(data.path().join(bucket)).expect("bucket dir");
        let mut s = S3Server {
            child: None,
            port: free_port(),
            data,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new(s3s_fs_binary())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(self.data.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start s3s-fs");
        self.child = Some(child);
        // Ready when the port accepts connections (it answers 403 without credentials).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("s3s-fs exited at start: {st}");
                }
            }
            assert!(
                Instant::now() < deadline,
                "s3s-fs did not listen on port {} within 30 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kill the server (SIGKILL) and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on the same port and data directory.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The data directory (bucket `b` is `data_dir()/b`).
    pub fn data_dir(&self) -> &Path {
        self.data.path()
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A client configuration for this server, with a short retry policy.
    pub fn config(&self) -> S3Config {
        S3Config {
            endpoint: Some(self.endpoint()),
            access_key_id: Some(ACCESS_KEY.into()),
            secret_access_key: Some(SECRET_KEY.into()),
            region: Some("us-east-1".into()),
            allow_http: Some(true),
            max_retries: 2,
            retry_timeout: Duration::from_secs(10),
            init_backoff: Duration::from_millis(50),
            ..S3Config::default()
        }
    }

    /// The environment a `ckpt` child process needs to reach this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("CKPT_S3_MAX_RETRIES", "2".into()),
            ("CKPT_S3_RETRY_TIMEOUT_S", "10".into()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.kill();
    }
}
