//! The cross-platform UAPI (`wg`'s protocol on `/var/run/wireguard/<dev>.sock`), served
//! from the device's own state. `set=1` changes peers in place: an endpoint or AllowedIPs
//! change leaves the peer's session alone; a request may carry any number of peers.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use ipnet::IpNet;
use x25519_dalek::StaticSecret;

use super::peers::{lock, read, write, Key, PeerConfig, State};

const EINVAL: i32 = 22;
const EPROTO: i32 = 71;
const EADDRINUSE: i32 = 98;
/// A request line longer than this is refused (the longest real one is a key).
const MAX_LINE: usize = 4096;
/// A request longer than this is refused: room for every peer of a 10,000-node mesh with
/// its AllowedIPs, while a client that never ends its request cannot fill the memory.
const MAX_REQUEST: usize = 32 << 20;

/// What a `set` asks of the device beyond its peer table.
pub trait Sockets: Send + Sync {
    /// Binds `port` (0: any) with `fwmark`; returns the port bound.
    fn rebind(&self, port: u16, fwmark: u32) -> std::io::Result<u16>;
}

/// A 32-byte key as UAPI writes it: 64 lowercase hex digits.
pub fn hex(bytes: &[u8; 32]) -> String {
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A key from 64 hex digits, or None.
pub fn unhex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, slot) in out.iter_mut().enumerate() {
        *slot = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// The answer to `get=1`.
pub fn get(state: &State) -> String {
    let mut out = String::new();
    if let Some(id) = &state.identity {
        let _ = writeln!(out, "private_key={}", hex(id.secret.as_bytes()));
    }
    let _ = writeln!(out, "listen_port={}", state.listen_port);
    if state.fwmark != 0 {
        let _ = writeln!(out, "fwmark={}", state.fwmark);
    }
    let now = SystemTime::now();
    for peer in state.peers.values() {
        let config = lock(&peer.config).clone();
        let (since, tx, rx) = lock(&peer.noise).stats(std::time::Instant::now());
        let _ = writeln!(out, "public_key={}", hex(&peer.key));
        if let Some(psk) = &config.psk {
            let _ = writeln!(out, "preshared_key={}", hex(psk));
        }
        let _ = writeln!(out, "protocol_version=1");
        if let Some(e) = peer.endpoint() {
            let _ = writeln!(out, "endpoint={e}");
        }
        if let Some(at) = since
            .and_then(|ago| now.checked_sub(ago))
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        {
            let _ = writeln!(out, "last_handshake_time_sec={}", at.as_secs());
            let _ = writeln!(out, "last_handshake_time_nsec={}", at.subsec_nanos());
        }
        let _ = writeln!(out, "tx_bytes={tx}\nrx_bytes={rx}");
        let _ = writeln!(out, "persistent_keepalive_interval={}", config.keepalive);
        for ip in &config.allowed_ips {
            let _ = writeln!(out, "allowed_ip={ip}");
        }
    }
    out.push_str("errno=0\n\n");
    out
}

/// One peer section of a `set` request, as it is being read.
struct PeerEdit {
    key: Key,
    config: PeerConfig,
    endpoint: Option<SocketAddr>,
    remove: bool,
    update_only: bool,
    exists: bool,
}

impl PeerEdit {
    fn apply(self, state: &mut State) -> Result<(), i32> {
        if self.remove {
            state.remove(&self.key);
        } else if !self.update_only || self.exists {
            state.upsert(self.key, self.config, self.endpoint);
        }
        Ok(())
    }
}

/// Device settings a `set` changed, applied once the request is read.
#[derive(Default)]
struct Pending {
    port: Option<u16>,
    fwmark: Option<u32>,
}

fn set_line(
    state: &mut State,
    edit: &mut Option<PeerEdit>,
    pending: &mut Pending,
    key: &str,
    value: &str,
) -> Result<(), i32> {
    let num = |v: &str| v.parse::<u32>().map_err(|_| EINVAL);
    match key {
        "private_key" => {
            let k = unhex(value).ok_or(EINVAL)?;
            state.set_private_key((k != [0; 32]).then(|| StaticSecret::from(k)));
        }
        "listen_port" => pending.port = Some(u16::try_from(num(value)?).map_err(|_| EINVAL)?),
        "fwmark" => pending.fwmark = Some(num(value)?),
        "replace_peers" if value == "true" => state.remove_all(),
        "public_key" => {
            if let Some(done) = edit.take() {
                done.apply(state)?;
            }
            let key = unhex(value).ok_or(EINVAL)?;
            let existing = state.peers.get(&key);
            *edit = Some(PeerEdit {
                key,
                config: existing
                    .map(|p| lock(&p.config).clone())
                    .unwrap_or_default(),
                endpoint: None,
                remove: false,
                update_only: false,
                exists: existing.is_some(),
            });
        }
        _ => {
            let e = edit.as_mut().ok_or(EINVAL)?;
            match key {
                "remove" if value == "true" => e.remove = true,
                "update_only" if value == "true" => e.update_only = true,
                "preshared_key" => {
                    let k = unhex(value).ok_or(EINVAL)?;
                    e.config.psk = (k != [0; 32]).then_some(k);
                }
                "endpoint" => e.endpoint = Some(value.parse().map_err(|_| EINVAL)?),
                "persistent_keepalive_interval" => {
                    e.config.keepalive = u16::try_from(num(value)?).map_err(|_| EINVAL)?
                }
                "replace_allowed_ips" if value == "true" => e.config.allowed_ips.clear(),
                // Truncated and kept once by `State::upsert`.
                "allowed_ip" => e
                    .config
                    .allowed_ips
                    .push(value.parse::<IpNet>().map_err(|_| EINVAL)?),
                "protocol_version" if value == "1" => {}
                "protocol_version" => return Err(EPROTO),
                _ => return Err(EINVAL),
            }
        }
    }
    Ok(())
}

/// Applies a `set=1` request (its lines after `set=1`); returns the errno to answer.
pub fn set(state: &RwLock<State>, sockets: &dyn Sockets, lines: &[String]) -> i32 {
    let mut pending = Pending::default();
    let result = {
        let mut st = write(state);
        let mut edit = None;
        let mut result = Ok(());
        for line in lines {
            let Some((k, v)) = line.split_once('=') else {
                result = Err(EINVAL);
                break;
            };
            result = set_line(&mut st, &mut edit, &mut pending, k, v);
            if let Err(errno) = result {
                // The field only: a value may be a key.
                let field: String = k.chars().take(40).collect();
                tracing::warn!(%field, errno, "UAPI set refused at this field");
                break;
            }
        }
        if let (Ok(()), Some(done)) = (&result, edit) {
            result = done.apply(&mut st);
        }
        st.commit();
        result
    };
    if let Err(errno) = result {
        return errno;
    }
    if pending.port.is_some() || pending.fwmark.is_some() {
        let (port, fwmark, unchanged) = {
            let st = read(state);
            let port = pending.port.unwrap_or(st.listen_port);
            let fwmark = pending.fwmark.unwrap_or(st.fwmark);
            let unchanged = port == st.listen_port && fwmark == st.fwmark && port != 0;
            (port, fwmark, unchanged)
        };
        if !unchanged {
            match sockets.rebind(port, fwmark) {
                Ok(bound) => {
                    let mut st = write(state);
                    st.listen_port = bound;
                    st.fwmark = fwmark;
                }
                Err(e) => {
                    tracing::warn!(port, error = %e, "cannot bind the listen port");
                    return EADDRINUSE;
                }
            }
        }
    }
    0
}

/// Reads one line of at most `MAX_LINE` bytes into `line`: `Ok(None)` for one longer.
fn read_line(reader: &mut impl BufRead, line: &mut String) -> std::io::Result<Option<usize>> {
    line.clear();
    let n = reader.by_ref().take(MAX_LINE as u64 + 1).read_line(line)?;
    Ok((n <= MAX_LINE).then_some(n))
}

/// Serves one client: requests until it hangs up. A line longer than `MAX_LINE` or a
/// request longer than `MAX_REQUEST` is answered with EINVAL and ends the connection,
/// having read no more than that.
fn serve_client(
    stream: UnixStream,
    state: &RwLock<State>,
    sockets: &dyn Sockets,
) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let refuse =
        |writer: &mut UnixStream| writer.write_all(format!("errno={EINVAL}\n\n").as_bytes());
    let mut first = String::new();
    let mut line = String::new();
    loop {
        match read_line(&mut reader, &mut first)? {
            Some(0) => return Ok(()),
            Some(_) => {}
            None => return refuse(&mut writer),
        }
        let mut lines = Vec::new();
        let mut size = first.len();
        loop {
            match read_line(&mut reader, &mut line)? {
                Some(n) if n > 0 && !line.trim_end().is_empty() => size += n,
                Some(_) => break,
                None => return refuse(&mut writer),
            }
            if size > MAX_REQUEST {
                return refuse(&mut writer);
            }
            lines.push(line.trim_end().to_string());
        }
        let answer = match first.trim_end() {
            "get=1" => get(&read(state)),
            "set=1" => format!("errno={}\n\n", set(state, sockets, &lines)),
            _ => format!("errno={EINVAL}\n\n"),
        };
        writer.write_all(answer.as_bytes())?;
    }
}

/// Accepts clients on `listener` until it fails; one thread per client.
pub fn serve(listener: UnixListener, state: Arc<RwLock<State>>, sockets: Arc<dyn Sockets>) {
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let (state, sockets) = (state.clone(), sockets.clone());
        let _ = std::thread::Builder::new()
            .name("wg-uapi".into())
            .spawn(move || {
                if let Err(e) = serve_client(client, &state, sockets.as_ref()) {
                    tracing::debug!(error = %e, "UAPI client gone");
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoSockets;
    impl Sockets for NoSockets {
        fn rebind(&self, port: u16, _: u32) -> std::io::Result<u16> {
            Ok(port)
        }
    }

    /// A line that never ends is refused once it passes the limit, having read no more.
    #[test]
    fn a_line_is_read_up_to_the_limit_only() {
        let mut endless = std::io::Cursor::new(vec![b'a'; 8 << 20]);
        let mut line = String::new();
        assert_eq!(read_line(&mut endless, &mut line).unwrap(), None);
        assert_eq!(endless.position(), MAX_LINE as u64 + 1);
        let mut fine = std::io::Cursor::new(b"get=1\n\n".to_vec());
        assert_eq!(read_line(&mut fine, &mut line).unwrap(), Some(6));
        assert_eq!(line, "get=1\n");
    }

    /// A client whose request never ends (first line, or a later one) is hung up on: the
    /// device stops reading, so the client cannot write it all.
    #[test]
    fn an_endless_request_is_hung_up_on() {
        for prefix in [&b""[..], b"set=1\n", b"get=1\n\nset=1\n"] {
            let (client, server) = UnixStream::pair().unwrap();
            let state = RwLock::new(State::default());
            let mut writer = client.try_clone().unwrap();
            let mut request = prefix.to_vec();
            request.extend(std::iter::repeat_n(b'a', 64 << 20));
            let sender = std::thread::spawn(move || writer.write_all(&request));
            serve_client(server, &state, &NoSockets).unwrap();
            assert!(sender.join().unwrap().is_err(), "{prefix:?}: read whole");
        }
    }

    fn hex_key(n: u8) -> String {
        hex(&[n; 32])
    }

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_string).collect()
    }

    /// A `set` as `wg setconf` sends it is read back by `get` as it was given; AllowedIPs
    /// are truncated to their network and kept once.
    #[test]
    fn a_set_is_read_back_by_get() {
        let state = RwLock::new(State::default());
        let request = format!(
            "private_key={}\nlisten_port=51820\npublic_key={}\nendpoint=192.0.2.1:51820\n\
             persistent_keepalive_interval=25\nallowed_ip=10.0.1.0/24\nallowed_ip=10.0.1.7/24\n\
             allowed_ip=fd00::1/64\npublic_key={}\nallowed_ip=10.0.2.0/24",
            hex_key(1),
            hex_key(2),
            hex_key(3)
        );
        assert_eq!(set(&state, &NoSockets, &lines(&request)), 0);
        let answer = get(&read(&state));
        for want in [
            "listen_port=51820".to_string(),
            format!("public_key={}", hex_key(2)),
            "endpoint=192.0.2.1:51820".into(),
            "persistent_keepalive_interval=25".into(),
            "allowed_ip=fd00::/64".into(),
            format!("public_key={}", hex_key(3)),
            "allowed_ip=10.0.2.0/24".into(),
        ] {
            assert!(answer.lines().any(|l| l == want), "{want} in:\n{answer}");
        }
        assert_eq!(
            answer.matches("allowed_ip=10.0.1.0/24").count(),
            1,
            "{answer}"
        );
        assert!(answer.ends_with("errno=0\n\n"));
    }

    /// Each bad request is refused with its errno, naming nothing of the value.
    #[test]
    fn bad_requests_get_their_errno() {
        let state = RwLock::new(State::default());
        for (request, errno) in [
            ("public_key=zz".to_string(), EINVAL),
            ("endpoint=192.0.2.1:51820".into(), EINVAL),
            (
                format!("public_key={}\nprotocol_version=2", hex_key(2)),
                EPROTO,
            ),
            (
                format!("public_key={}\nallowed_ip=10.0.0.0/33", hex_key(2)),
                EINVAL,
            ),
            (
                format!("public_key={}\nno_such_field=1", hex_key(2)),
                EINVAL,
            ),
            ("listen_port=65536".into(), EINVAL),
            ("no equals sign".into(), EINVAL),
        ] {
            assert_eq!(
                set(&state, &NoSockets, &lines(&request)),
                errno,
                "{request}"
            );
        }
        assert!(read(&state).peers.is_empty(), "no bad request added a peer");
    }

    /// `update_only` changes a peer that exists and never adds one; `remove` removes it;
    /// `replace_allowed_ips` replaces its AllowedIPs, which leave the peer that had them.
    #[test]
    fn update_only_remove_and_replace_allowed_ips() {
        let state = RwLock::new(State::default());
        let two = hex_key(2);
        let three = hex_key(3);
        let run = |request: String| assert_eq!(set(&state, &NoSockets, &lines(&request)), 0);
        run(format!(
            "public_key={three}\nupdate_only=true\nallowed_ip=10.0.3.0/24"
        ));
        assert!(read(&state).peers.is_empty());
        run(format!("public_key={two}\nallowed_ip=10.0.2.0/24"));
        run(format!("public_key={three}\nallowed_ip=10.0.3.0/24"));
        run(format!(
            "public_key={three}\nupdate_only=true\nreplace_allowed_ips=true\nallowed_ip=10.0.2.0/24"
        ));
        let answer = get(&read(&state));
        assert!(!answer.contains("allowed_ip=10.0.3.0/24"), "{answer}");
        assert_eq!(
            answer.matches("allowed_ip=10.0.2.0/24").count(),
            1,
            "{answer}"
        );
        assert_eq!(
            read(&state)
                .route("10.0.2.1".parse().unwrap())
                .map(|p| p.key),
            Some([3; 32])
        );
        run(format!("public_key={two}\nremove=true"));
        assert_eq!(read(&state).peers.len(), 1);
    }
}
