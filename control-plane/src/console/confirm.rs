//! The page that asks before something that cannot be undone or that takes money
//! (revoking a key, removing a member, buying credits, changing a plan): it shows what
//! will happen, and its button POSTs the reviewed values.

use super::page::Frame;
use askama::Template;

#[derive(Template)]
#[template(path = "confirm.html")]
pub struct Confirm {
    pub frame: Frame,
    pub question: String,
    pub detail: String,
    /// Where the button POSTs.
    pub action: String,
    pub button: String,
    pub back: String,
    /// The reviewed values the button sends (name, value).
    pub fields: Vec<(&'static str, String)>,
    /// Whether the button reads as destructive (red) rather than as a purchase.
    pub danger: bool,
}
