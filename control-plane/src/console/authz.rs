//! Who may do what: the one decision every organization page and action asks for.
//!
//! An owner invites and removes members, changes
//! roles, manages billing, creates and revokes keys and changes settings; a member uses
//! keys and views usage and billing. Someone outside the organization learns nothing
//! about it, not even that it exists: a 404, as for an organization that does not.
//! Membership is read on every request, so a removed member loses access at once.

use super::Console;
use super::page::ConsoleError;
use super::session::Viewer;
use crate::accounts::{Membership, Role};

/// What a request does to an organization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// The dashboard, the member list and invites, the key list.
    View,
    /// Invite, resend, cancel; change roles; remove members.
    ManageMembers,
    /// Create and revoke keys.
    ManageKeys,
    /// Rename the organization.
    ManageSettings,
    /// Buy credits, start and change plans (the console's billing pages).
    ManageBilling,
}

/// The rule itself.
pub fn permits(role: Role, action: Action) -> bool {
    match action {
        Action::View => true,
        Action::ManageMembers | Action::ManageKeys | Action::ManageSettings | Action::ManageBilling => {
            role == Role::Owner
        }
    }
}

/// The viewer's membership of `org_id` if they may do `action` there: 404 for an
/// organization they are not in, 403 for an action their role does not allow.
pub async fn authorize(
    console: &Console,
    viewer: &Viewer,
    org_id: &str,
    action: Action,
) -> Result<Membership, ConsoleError> {
    let membership = console.store.membership(viewer.user_id(), org_id).await?.ok_or(ConsoleError::NotFound)?;
    if !permits(membership.role, action) {
        return Err(ConsoleError::Forbidden);
    }
    Ok(membership)
}

/// What a page may offer its viewer: controls are shown only where the action would be
/// allowed (the server checks again when it is taken).
#[derive(Debug, Clone, Copy)]
pub struct Offers {
    pub manage_members: bool,
    pub manage_keys: bool,
    pub manage_settings: bool,
    pub manage_billing: bool,
}

impl Offers {
    pub fn for_role(role: Role) -> Self {
        Self {
            manage_members: permits(role, Action::ManageMembers),
            manage_keys: permits(role, Action::ManageKeys),
            manage_settings: permits(role, Action::ManageSettings),
            manage_billing: permits(role, Action::ManageBilling),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_manage_and_members_view() {
        for action in
            [Action::View, Action::ManageMembers, Action::ManageKeys, Action::ManageSettings, Action::ManageBilling]
        {
            assert!(permits(Role::Owner, action), "{action:?}");
            assert_eq!(permits(Role::Member, action), action == Action::View, "{action:?}");
        }
    }
}
