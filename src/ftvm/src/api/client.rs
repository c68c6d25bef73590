//! Client side of the control socket, used by `ftvm snapshot` and `ftvm status`.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::{Request, Response};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the VMM at {path}: {err}")]
    Connect { path: String, err: std::io::Error },
    #[error("control socket {path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("control socket {path} sent an invalid response: {err}")]
    Protocol { path: String, err: String },
    #[error("the VMM refused: {0}")]
    Refused(String),
}

pub fn call(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let path = socket.display().to_string();
    let io = |err| ClientError::Io { path: path.clone(), err };
    let mut stream = UnixStream::connect(socket).map_err(|err| ClientError::Connect { path: path.clone(), err })?;
    let mut line = serde_json::to_string(request).expect("requests serialize");
    line.push('\n');
    stream.write_all(line.as_bytes()).map_err(io)?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).map_err(io)?;
    let response: Response = serde_json::from_str(&reply).map_err(|e| ClientError::Protocol { path: path.clone(), err: e.to_string() })?;
    if !response.ok {
        return Err(ClientError::Refused(response.error.unwrap_or_else(|| "unknown error".into())));
    }
    Ok(response)
}
