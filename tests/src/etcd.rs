//! A real etcd (Debian `etcd-server`) for tests and the demo: its own data directory and
//! loopback ports chosen at run time, stoppable and restartable on the same data, killed on
//! drop. Fails loudly, naming the fix, when the binary is missing.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

pub struct Etcd {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Where it listens: loopback, or an address inside `netns`.
    host: String,
    client_port: u16,
    peer_port: u16,
    /// A named network namespace to run in (the lab's), instead of the caller's.
    netns: Option<String>,
    /// Serve TLS only, and require client certificates, with the certificates of this
    /// directory (`pki::Pki`): `https://` endpoints.
    tls: Option<PathBuf>,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Path of the etcd binary, or an error saying how to install it.
pub fn etcd_binary() -> anyhow::Result<PathBuf> {
    for dir in ["/usr/bin", "/usr/local/bin", "/usr/sbin"] {
        let path = PathBuf::from(dir).join("etcd");
        if path.exists() {
            return Ok(path);
        }
    }
    bail!("etcd not found: install Debian's etcd-server (`apt-get install etcd-server`, or run scripts/install-deps)")
}

impl Etcd {
    /// A running etcd. The free ports are picked before etcd binds them, so another test
    /// may take one in between; then it starts again on fresh ports.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(None)
    }

    /// A running etcd that speaks only TLS, with the server certificate and CA of `pki`,
    /// and requires a client certificate signed by that CA (`--client-cert-auth`).
    pub fn start_tls(pki: &crate::pki::Pki) -> anyhow::Result<Self> {
        Self::start_with(Some(pki.dir().to_path_buf()))
    }

    fn start_with(tls: Option<PathBuf>) -> anyhow::Result<Self> {
        let mut attempt = 0;
        loop {
            let mut etcd = Etcd::reserve()?;
            etcd.tls = tls.clone();
            match etcd.launch() {
                Ok(()) => return Ok(etcd),
                Err(e) if attempt < 4 && format!("{e:#}").contains("address already in use") => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Ports and a data directory, with etcd not yet running (for "etcd is down at start").
    pub fn reserve() -> anyhow::Result<Self> {
        Ok(Etcd {
            child: None,
            dir: tempfile::Builder::new().prefix("weft-etcd-").tempdir()?,
            host: "127.0.0.1".into(),
            client_port: free_port()?,
            peer_port: free_port()?,
            netns: None,
            tls: None,
        })
    }

    /// An etcd to run inside the named network namespace, listening on `host` there.
    pub fn reserve_in(netns: &str, host: &str) -> anyhow::Result<Self> {
        Ok(Etcd {
            child: None,
            dir: tempfile::Builder::new().prefix("weft-etcd-").tempdir()?,
            host: host.to_string(),
            client_port: 2379,
            peer_port: 2380,
            netns: Some(netns.to_string()),
            tls: None,
        })
    }

    /// `etcdctl` against this etcd (run in its namespace), e.g. `["put", "/k", "v"]`.
    pub fn etcdctl(&self, args: &[&str]) -> anyhow::Result<String> {
        self.ctl().run(args)
    }

    /// A handle that runs `etcdctl` against this etcd from any thread.
    pub fn ctl(&self) -> EtcdCtl {
        EtcdCtl {
            netns: self.netns.clone(),
            endpoint: self.endpoint(),
            tls: self.tls.clone(),
        }
    }

    /// The named network namespace etcd runs in, if any.
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// Puts many keys at once (transactions of 100), from inside etcd's namespace.
    pub fn put_many(&self, kvs: Vec<(String, String)>) -> anyhow::Result<()> {
        let endpoint = self.endpoint();
        let work = move || -> anyhow::Result<()> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async move {
                let mut client = etcd_client::Client::connect([endpoint], None).await?;
                for chunk in kvs.chunks(100) {
                    let ops: Vec<etcd_client::TxnOp> = chunk
                        .iter()
                        .map(|(k, v)| etcd_client::TxnOp::put(k.as_str(), v.as_str(), None))
                        .collect();
                    client.txn(etcd_client::Txn::new().and_then(ops)).await?;
                }
                Ok(())
            })
        };
        match &self.netns {
            Some(ns) => crate::netns::in_named_netns(ns, work)
                .join()
                .map_err(|_| anyhow::anyhow!("the etcd writer panicked"))??,
            None => work(),
        }
    }

    fn command_in_netns(&self, program: &str) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, program]);
                c
            }
            None => Command::new(program),
        }
    }

    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.host, self.client_port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    /// Starts etcd on this fixture's data and ports and waits until it is healthy.
    pub fn launch(&mut self) -> anyhow::Result<()> {
        let peer = format!("http://{}:{}", self.host, self.peer_port);
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut command = self.command_in_netns(&etcd_binary()?.to_string_lossy());
        command
            .args(["--name", "lab", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &self.endpoint(),
                "--advertise-client-urls",
                &self.endpoint(),
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args([
                "--initial-cluster",
                &format!("lab={peer}"),
                "--initial-cluster-state",
                "new",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(dir) = &self.tls {
            command
                .arg("--cert-file")
                .arg(dir.join("server.pem"))
                .arg("--key-file")
                .arg(dir.join("server-key.pem"))
                .arg("--trusted-ca-file")
                .arg(dir.join("ca.pem"))
                .arg("--client-cert-auth");
        }
        self.child = Some(command.spawn().context("starting etcd")?);
        self.wait_healthy()
    }

    fn wait_healthy(&mut self) -> anyhow::Result<()> {
        // Healthy, or exited (an error at once).
        let started = crate::wait::first_within(Duration::from_secs(20), || {
            let exited = self.child.as_mut().map(|c| c.try_wait());
            match exited {
                Some(Ok(Some(status))) => {
                    Some(Err(anyhow::anyhow!("etcd exited with {status} at start")))
                }
                Some(Err(e)) => Some(Err(e.into())),
                _ => self.healthy().then_some(Ok(())),
            }
        });
        match started {
            Some(Ok(())) => return Ok(()),
            Some(Err(e)) => bail!("{e}; log:\n{}", self.log_tail()),
            None => {}
        }
        bail!(
            "etcd did not become healthy in 20 s; log:\n{}",
            self.log_tail()
        )
    }

    fn healthy(&self) -> bool {
        if self.netns.is_some() || self.tls.is_some() {
            return self.etcdctl(&["endpoint", "health"]).is_ok();
        }
        let Ok(mut conn) = TcpStream::connect(("127.0.0.1", self.client_port)) else {
            return false;
        };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
        let mut reply = String::new();
        conn.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_ok()
            && conn.read_to_string(&mut reply).is_ok()
            && reply.contains("\"health\":\"true\"")
    }

    /// The last lines etcd logged, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Kills etcd (its data stays).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same data and ports.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.launch()
    }

    /// `etcdctl snapshot save` to `path`.
    pub fn snapshot(&self, path: &std::path::Path) -> anyhow::Result<()> {
        self.etcdctl(&["snapshot", "save", &path.to_string_lossy()])
            .map(|_| ())
    }

    /// Kills etcd, wipes its data, restores `snapshot` into it (as an operator recovering
    /// a lost member would) and starts it again.
    pub fn wipe_and_restore(&mut self, snapshot: &std::path::Path) -> anyhow::Result<()> {
        self.stop();
        let data = self.dir.path().join("data");
        std::fs::remove_dir_all(&data).context("wiping etcd's data")?;
        let peer = format!("http://{}:{}", self.host, self.peer_port);
        let out = Command::new("etcdctl")
            .args(["snapshot", "restore"])
            .arg(snapshot)
            .arg(format!("--data-dir={}", data.display()))
            .args(["--name=lab", &format!("--initial-cluster=lab={peer}")])
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .output()
            .context("etcdctl snapshot restore")?;
        if !out.status.success() {
            bail!(
                "etcdctl snapshot restore: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        self.launch()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `etcdctl` against one etcd (`Etcd::ctl`).
#[derive(Debug, Clone)]
pub struct EtcdCtl {
    netns: Option<String>,
    endpoint: String,
    tls: Option<PathBuf>,
}

impl EtcdCtl {
    /// Runs `etcdctl args` (in the etcd's namespace); its output.
    pub fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcdctl"]);
                c
            }
            None => Command::new("etcdctl"),
        };
        command
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.endpoint));
        if let Some(dir) = &self.tls {
            command
                .arg(format!("--cacert={}", dir.join("ca.pem").display()))
                .arg(format!("--cert={}", dir.join("client.pem").display()))
                .arg(format!("--key={}", dir.join("client-key.pem").display()));
        }
        command.args(args);
        let out = command.output().context("running etcdctl")?;
        if !out.status.success() {
            bail!(
                "etcdctl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
