//! The page that asks before something that cannot be undone (revoking a key,
//! removing a member): a GET shows it, its button POSTs.

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
}
