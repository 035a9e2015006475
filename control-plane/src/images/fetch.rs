//! An image's bytes from its URL: a base64 data URI, or an http(s) address fetched
//! under limits — a size cap read as the body arrives, a time-out, a redirect cap —
//! and, unless the operator allows them, never from internal addresses
//! (`address::internal`). Every address is checked where it is connected to: the DNS
//! resolver hands the HTTP client only the addresses that pass (no window between a
//! check and a second lookup for DNS rebinding to use), and literal IP hosts, which
//! never reach a resolver, are checked before the first request and at every redirect.

use super::address::internal;
use super::{ImageConfig, ImageError};
use base64::Engine;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::{Client, Url, redirect};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// Fetches image bytes; one per process (it keeps connections).
#[derive(Clone)]
pub struct Fetcher {
    client: Client,
    config: ImageConfig,
}

/// A refusal raised inside the client (resolver, redirect policy), found again in the
/// error's chain of sources.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("{0}")]
    Internal(String),
    #[error("more than {0} redirects")]
    Redirects(usize),
    #[error("a redirect to {0}, which is not http(s)")]
    Scheme(String),
}

impl Fetcher {
    pub fn new(config: ImageConfig) -> anyhow::Result<Self> {
        let (allow, max_redirects) = (config.allow_internal, config.max_redirects);
        let policy = redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() > max_redirects {
                return attempt.error(Refusal::Redirects(max_redirects));
            }
            match check_hop(attempt.url(), allow) {
                Ok(()) => attempt.follow(),
                Err(refusal) => attempt.error(refusal),
            }
        });
        let client = Client::builder()
            .no_proxy()
            .connect_timeout(config.timeout)
            .timeout(config.timeout)
            .redirect(policy)
            .dns_resolver(Arc::new(Guarded { allow }))
            .user_agent(concat!("tessera/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self { client, config })
    }

    /// The bytes behind `url`.
    pub async fn bytes(&self, url: &str) -> Result<Vec<u8>, ImageError> {
        if let Some(rest) = url.strip_prefix("data:") {
            return self.data_uri(rest);
        }
        let parsed = Url::parse(url).map_err(|e| ImageError::BadUrl(format!("{e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none_or(str::is_empty) {
            return Err(ImageError::BadUrl(format!(
                "expected an http(s) URL or a base64 data URI, got {:?}",
                url.chars().take(40).collect::<String>()
            )));
        }
        check_hop(&parsed, self.config.allow_internal).map_err(|r| classify_refusal(&r))?;
        let mut response = self.client.get(parsed).send().await.map_err(|e| classify(&e))?;
        let status = response.status();
        // A redirect the client did not follow: to a scheme it does not fetch, or
        // without a Location to go to.
        if status.is_redirection() {
            let to = response.headers().get(reqwest::header::LOCATION).and_then(|l| l.to_str().ok()).unwrap_or("");
            return Err(ImageError::Unreachable(format!("a redirect to {to:?}, which is not http(s)")));
        }
        if !status.is_success() {
            return Err(ImageError::Unreachable(format!("the server answered {status}")));
        }
        let cap = self.config.max_bytes;
        if response.content_length().is_some_and(|n| n > cap as u64) {
            return Err(ImageError::TooLarge(cap));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| classify(&e))? {
            if body.len() + chunk.len() > cap {
                return Err(ImageError::TooLarge(cap));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// `data:image/<type>;base64,<payload>`, decoded within the size cap.
    fn data_uri(&self, rest: &str) -> Result<Vec<u8>, ImageError> {
        let (meta, payload) = rest
            .split_once(',')
            .ok_or_else(|| ImageError::BadUrl("a data URI needs a ',' before its payload".into()))?;
        if !meta.starts_with("image/") || !meta.ends_with(";base64") {
            return Err(ImageError::BadUrl(format!("expected data:image/<type>;base64,…, got data:{meta},…")));
        }
        let payload = payload.trim();
        // Refused before decoding: base64 holds 3 bytes in 4 characters.
        if payload.len() / 4 * 3 > self.config.max_bytes + 3 {
            return Err(ImageError::TooLarge(self.config.max_bytes));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(payload)
            .map_err(|e| ImageError::BadUrl(format!("invalid base64 image data: {e}")))?;
        if bytes.len() > self.config.max_bytes {
            return Err(ImageError::TooLarge(self.config.max_bytes));
        }
        Ok(bytes)
    }
}

/// Whether a fetch may go to `url` (the first request or a redirect): http(s) only, and
/// no literal internal address unless `allow`. Host names are judged by the resolver.
fn check_hop(url: &Url, allow: bool) -> Result<(), Refusal> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refusal::Scheme(url.scheme().to_string()));
    }
    match literal_ip(url) {
        Some(ip) if !allow && internal(ip) => Err(Refusal::Internal(refused(ip))),
        _ => Ok(()),
    }
}

fn literal_ip(url: &Url) -> Option<IpAddr> {
    match url.host()? {
        url::Host::Ipv4(v4) => Some(IpAddr::V4(v4)),
        url::Host::Ipv6(v6) => Some(IpAddr::V6(v6)),
        url::Host::Domain(_) => None,
    }
}

fn refused(ip: IpAddr) -> String {
    format!("the image's address {ip} is internal; this server does not fetch from internal networks")
}

/// What went wrong, in words for the client: a refusal of ours if there is one in the
/// chain; else whether it timed out, or the server could not be reached at all (not
/// why: refused and unanswered connections must not read differently, or the fetcher
/// becomes a port scanner).
fn classify(e: &reqwest::Error) -> ImageError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<Refusal>() {
            return classify_refusal(r);
        }
        source = s.source();
    }
    if e.is_timeout() {
        return ImageError::TimedOut;
    }
    let host = e.url().and_then(Url::host_str).unwrap_or("its host");
    ImageError::Unreachable(format!("no answer from {host}"))
}

fn classify_refusal(r: &Refusal) -> ImageError {
    match r {
        Refusal::Internal(m) => ImageError::Refused(m.clone()),
        Refusal::Redirects(_) | Refusal::Scheme(_) => ImageError::Unreachable(r.to_string()),
    }
}

/// The system resolver, keeping only the addresses a fetch may use.
struct Guarded {
    allow: bool,
}

impl Resolve for Guarded {
    fn resolve(&self, name: Name) -> Resolving {
        let allow = self.allow;
        Box::pin(async move {
            let host = name.as_str().to_string();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let usable: Vec<SocketAddr> = found.iter().copied().filter(|a| allow || !internal(a.ip())).collect();
            if usable.is_empty() {
                let first = found.first().map_or_else(|| host.clone(), |a| a.ip().to_string());
                return Err(Box::new(Refusal::Internal(format!(
                    "the image's host {host} resolves to an internal address ({first}); this server does not fetch \
                     from internal networks"
                ))) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(usable.into_iter()) as Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ImageConfig, ImageError, Images, Refused};
    use axum::Router;
    use axum::body::Body;
    use axum::extract::Path;
    use axum::http::{StatusCode, header};
    use axum::response::{IntoResponse, Redirect, Response};
    use axum::routing::get;
    use base64::Engine;
    use std::time::Duration;

    const CAP: usize = 4096;

    fn png() -> Vec<u8> {
        let img = image::RgbImage::from_fn(5, 3, |x, y| image::Rgb([x as u8 * 40, y as u8 * 80, 7]));
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    /// A loopback server with one route per case.
    async fn server() -> String {
        let app = Router::new()
            // The content type is wrong on purpose: formats are sniffed from the bytes.
            .route("/cat.png", get(|| async { ([(header::CONTENT_TYPE, "text/plain")], png()) }))
            .route("/notes.txt", get(|| async { "just some text" }))
            .route("/cut.png", get(|| async { png()[..40].to_vec() }))
            .route("/declared-large", get(|| async { vec![0u8; CAP + 1] }))
            .route(
                "/streamed-large",
                get(|| async {
                    let chunks = (0..8).map(|_| Ok::<_, std::io::Error>(vec![0x89u8; CAP / 4]));
                    Body::from_stream(futures_util::stream::iter(chunks))
                }),
            )
            .route(
                "/hop/{n}",
                get(|Path(n): Path<u32>| async move {
                    if n == 0 {
                        Redirect::temporary("/cat.png")
                    } else {
                        Redirect::temporary(&format!("/hop/{}", n - 1))
                    }
                }),
            )
            .route("/to-file", get(|| async { Redirect::temporary("file:///etc/passwd") }))
            .route("/missing", get(|| async { StatusCode::NOT_FOUND.into_response() }))
            .route("/stall", get(std::future::pending::<Response>));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    fn images(allow_internal: bool) -> Images {
        Images::new(ImageConfig {
            max_bytes: CAP,
            timeout: Duration::from_millis(500),
            max_redirects: 3,
            allow_internal,
            max_images: 2,
            ..ImageConfig::default()
        })
        .unwrap()
    }

    #[tokio::test]
    async fn every_bad_image_is_refused_with_its_reason() {
        let base = server().await;
        let images = images(true);
        let ok = images.load(&format!("{base}/cat.png")).await.unwrap();
        assert_eq!((ok.format, ok.width, ok.height), ("PNG", 5, 3));
        assert_eq!(ok.bytes, png());
        let hopped = images.load(&format!("{base}/hop/2")).await.unwrap();
        assert_eq!(hopped.sha256, ok.sha256);
        let inline = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png()));
        assert_eq!(images.load(&inline).await.unwrap().sha256, ok.sha256);

        type Case = (String, fn(&ImageError) -> bool, &'static str);
        let cases: [Case; 12] = [
            (format!("{base}/notes.txt"), |e| matches!(e, ImageError::Decode(_)), "not an image"),
            (format!("{base}/cut.png"), |e| matches!(e, ImageError::Decode(_)), "cannot be decoded"),
            (format!("{base}/declared-large"), |e| matches!(e, ImageError::TooLarge(_)), "larger than the limit"),
            (format!("{base}/streamed-large"), |e| matches!(e, ImageError::TooLarge(_)), "larger than the limit"),
            (format!("{base}/hop/5"), |e| matches!(e, ImageError::Unreachable(_)), "more than 3 redirects"),
            (format!("{base}/to-file"), |e| matches!(e, ImageError::Unreachable(_)), "not http(s)"),
            (format!("{base}/missing"), |e| matches!(e, ImageError::Unreachable(_)), "404"),
            (format!("{base}/stall"), |e| matches!(e, ImageError::TimedOut), "in time"),
            // Nothing listens on port 9 of loopback.
            (
                "http://127.0.0.1:9/x.png".into(),
                |e| matches!(e, ImageError::Unreachable(_)),
                "no answer from 127.0.0.1",
            ),
            ("ftp://example.com/x.png".into(), |e| matches!(e, ImageError::BadUrl(_)), "http(s) URL"),
            ("data:image/png;base64,***".into(), |e| matches!(e, ImageError::BadUrl(_)), "invalid base64"),
            (
                format!("data:image/png;base64,{}", "A".repeat(CAP * 2)),
                |e| matches!(e, ImageError::TooLarge(_)),
                "larger than the limit",
            ),
        ];
        for (url, expected, words) in cases {
            let e = images.load(&url).await.unwrap_err();
            assert!(expected(&e), "{url}: {e:?}");
            assert!(e.to_string().contains(words), "{url}: {e}");
        }
    }

    #[tokio::test]
    async fn images_together_are_capped_and_the_part_going_over_is_named() {
        let inline = format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png()));
        let one = png().len();
        let images =
            Images::new(ImageConfig { max_total_bytes: one * 2, max_images: 8, ..ImageConfig::default() }).unwrap();
        let parts: Vec<(String, String)> =
            (0..3).map(|i| (format!("messages[0].content[{i}]"), inline.clone())).collect();
        assert_eq!(images.load_all(&parts[..2]).await.unwrap().len(), 2);
        let e = images.load_all(&parts).await.unwrap_err();
        let Refused::Part { param, error: ImageError::TooLargeTogether(_) } = &e else { panic!("{e:?}") };
        assert_eq!(param, "messages[0].content[2]");
        assert!(e.to_string().contains("together are larger"), "{e}");
    }

    #[test]
    fn each_hop_is_checked_for_scheme_and_literal_internal_addresses() {
        use super::{Refusal, check_hop};
        let url = |u: &str| reqwest::Url::parse(u).unwrap();
        assert!(matches!(check_hop(&url("http://127.0.0.1/x"), false), Err(Refusal::Internal(_))));
        assert!(matches!(check_hop(&url("https://[::ffff:a9fe:a9fe]/"), false), Err(Refusal::Internal(_))));
        assert!(matches!(check_hop(&url("file:///etc/passwd"), true), Err(Refusal::Scheme(_))));
        assert!(check_hop(&url("http://127.0.0.1/x"), true).is_ok());
        assert!(check_hop(&url("https://8.8.8.8/x"), false).is_ok());
        // Names go to the resolver, which judges the addresses they have.
        assert!(check_hop(&url("http://localhost/x"), false).is_ok());
    }

    #[tokio::test]
    async fn internal_addresses_are_refused_unless_allowed() {
        let base = server().await;
        let port = base.rsplit(':').next().unwrap();
        let guarded = images(false);
        for url in [
            format!("{base}/cat.png"),
            format!("http://localhost:{port}/cat.png"),
            format!("http://[::1]:{port}/cat.png"),
            format!("http://[::ffff:127.0.0.1]:{port}/cat.png"),
            "http://169.254.169.254/latest/meta-data/".into(),
            "http://10.0.0.1/x.png".into(),
        ] {
            let e = guarded.load(&url).await.unwrap_err();
            assert!(matches!(e, ImageError::Refused(_)), "{url}: {e:?}");
            assert!(e.to_string().contains("internal"), "{url}: {e}");
        }
        // The same server is fetched when the operator allows internal addresses.
        assert!(images(true).load(&format!("http://localhost:{port}/cat.png")).await.is_ok());
    }

    #[tokio::test]
    async fn a_request_names_the_part_that_failed_and_caps_its_images() {
        let base = server().await;
        let images = images(true);
        let parts = |urls: &[&str]| -> Vec<(String, String)> {
            urls.iter()
                .enumerate()
                .map(|(j, u)| (format!("messages[0].content[{j}].image_url"), format!("{base}{u}")))
                .collect()
        };
        assert_eq!(images.load_all(&parts(&["/cat.png", "/hop/1"])).await.unwrap().len(), 2);
        let e = images.load_all(&parts(&["/cat.png", "/notes.txt"])).await.unwrap_err();
        let Refused::Part { param, error: ImageError::Decode(_) } = &e else { panic!("{e:?}") };
        assert_eq!(param, "messages[0].content[1].image_url");
        assert!(e.to_string().contains("not an image"), "{e}");
        let e = images.load_all(&parts(&["/cat.png", "/cat.png", "/cat.png"])).await.unwrap_err();
        let Refused::Part { param, error: ImageError::TooMany(2) } = &e else { panic!("{e:?}") };
        assert_eq!(param, "messages[0].content[2].image_url");
        assert!(e.to_string().contains("at most 2 images"));
    }
}
