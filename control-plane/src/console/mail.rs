//! Outgoing e-mail: over SMTP when `--smtp-url` is given, else written as `.eml` files
//! to `<data-dir>/outbox/` (what `tessera serve` does out of the box), which the log
//! names. Message bodies carry invite codes: they are never logged.

use lettre::message::{Mailbox, header::ContentType};
use lettre::transport::smtp::authentication::Credentials;
use lettre::{AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor};
use std::path::PathBuf;

pub enum Mailer {
    Smtp { transport: AsyncSmtpTransport<Tokio1Executor>, from: Mailbox },
    Outbox { dir: PathBuf, from: Mailbox },
}

/// Where a message went.
#[derive(Debug, PartialEq)]
pub enum Delivery {
    Sent,
    Written(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum MailError {
    #[error("{0}")]
    Config(String),
    #[error("the e-mail could not be built: {0}")]
    Build(String),
    #[error("the mail server refused or could not be reached: {0}")]
    Smtp(String),
    #[error("writing the outbox: {0}")]
    Outbox(#[from] std::io::Error),
}

impl Mailer {
    /// SMTP at `smtp://[user:password@]host[:port]` (plain SMTP, port 25 by default:
    /// run a local relay for TLS to a provider), or the outbox folder without one.
    pub fn new(smtp_url: Option<&str>, from: &str, outbox: PathBuf) -> Result<Self, MailError> {
        let from: Mailbox = from.parse().map_err(|e| MailError::Config(format!("--smtp-from {from:?}: {e}")))?;
        let Some(url) = smtp_url else { return Ok(Self::Outbox { dir: outbox, from }) };
        // Errors name the URL without its user and password.
        let shown = match url.split_once("://") {
            Some((scheme, rest)) => format!("{scheme}://{}", rest.rsplit_once('@').map_or(rest, |(_, host)| host)),
            None => url.rsplit_once('@').map_or(url, |(_, host)| host).to_string(),
        };
        let rest = url.strip_prefix("smtp://").ok_or_else(|| {
            MailError::Config(format!("--smtp-url {shown:?}: use smtp://[user:password@]host[:port]"))
        })?;
        let rest = rest.trim_end_matches('/');
        let (credentials, server) = match rest.rsplit_once('@') {
            Some((user_pass, server)) => {
                let (user, pass) = user_pass.split_once(':').unwrap_or((user_pass, ""));
                (Some(Credentials::new(percent_decode(user), percent_decode(pass))), server)
            }
            None => (None, rest),
        };
        let (host, port) = match server.rsplit_once(':') {
            Some((host, port)) => {
                (host, port.parse::<u16>().map_err(|_| MailError::Config(format!("--smtp-url: bad port {port:?}")))?)
            }
            None => (server, 25),
        };
        if host.is_empty() {
            return Err(MailError::Config(format!("--smtp-url {shown:?} names no host")));
        }
        let mut builder = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(host).port(port);
        if let Some(credentials) = credentials {
            builder = builder.credentials(credentials);
        }
        Ok(Self::Smtp { transport: builder.build(), from })
    }

    /// Sends a plain-text message to `to`.
    pub async fn send(&self, to: &str, subject: &str, body: String) -> Result<Delivery, MailError> {
        let from = match self {
            Self::Smtp { from, .. } | Self::Outbox { from, .. } => from.clone(),
        };
        let to: Mailbox = to.parse().map_err(|e| MailError::Build(format!("{to:?}: {e}")))?;
        let message = Message::builder()
            .from(from)
            .to(to)
            .subject(subject)
            .header(ContentType::TEXT_PLAIN)
            .body(body)
            .map_err(|e| MailError::Build(e.to_string()))?;
        match self {
            Self::Smtp { transport, .. } => {
                transport.send(message).await.map_err(|e| MailError::Smtp(e.to_string()))?;
                Ok(Delivery::Sent)
            }
            Self::Outbox { dir, .. } => {
                let name = format!(
                    "{}-{}.eml",
                    crate::accounts::store::now(),
                    crate::accounts::keys::random_id("").get(..12).unwrap_or("0")
                );
                let path = dir.join(name);
                // Messages carry live invite codes: readable by this user only.
                let (dir, file, bytes) = (dir.clone(), path.clone(), message.formatted());
                tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                    use std::io::Write;
                    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
                    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
                    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&file)?;
                    f.write_all(&bytes)
                })
                .await
                .map_err(std::io::Error::other)??;
                tracing::info!(path = %path.display(), "no --smtp-url: wrote the e-mail to the outbox");
                Ok(Delivery::Written(path))
            }
        }
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn without_smtp_messages_land_in_the_outbox() {
        let dir = tempfile::tempdir().unwrap();
        let mailer = Mailer::new(None, "Tessera <noreply@localhost>", dir.path().join("outbox")).unwrap();
        let Delivery::Written(path) =
            mailer.send("ada@example.com", "Hello", "Line one\nhttp://x/accept".into()).await.unwrap()
        else {
            panic!("written")
        };
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("To: ada@example.com") && text.contains("Subject: Hello"), "{text}");
        assert!(text.contains("http://x/accept"), "{text}");
        assert!(text.contains("Content-Type: text/plain"), "{text}");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    /// (In a runtime: the SMTP pool starts a task.)
    #[tokio::test]
    async fn smtp_urls_are_read_or_refused_clearly() {
        let outbox = PathBuf::from("/nonexistent");
        let from = "Tessera <noreply@localhost>";
        assert!(matches!(Mailer::new(Some("smtp://127.0.0.1:2525"), from, outbox.clone()), Ok(Mailer::Smtp { .. })));
        assert!(matches!(
            Mailer::new(Some("smtp://u%40x:p@mail.example"), from, outbox.clone()),
            Ok(Mailer::Smtp { .. })
        ));
        for bad in ["smtps://mail.example", "mail.example", "smtp://:25", "smtp://h:port"] {
            assert!(matches!(Mailer::new(Some(bad), from, outbox.clone()), Err(MailError::Config(_))), "{bad}");
        }
        assert!(matches!(Mailer::new(None, "not an address", outbox.clone()), Err(MailError::Config(_))));
        let Err(e) = Mailer::new(Some("smtps://user:hunter2@mail.example"), from, outbox) else { panic!("refused") };
        assert!(!e.to_string().contains("hunter2") && e.to_string().contains("mail.example"), "{e}");
        assert_eq!(percent_decode("a%40b%2"), "a@b%2");
    }
}
