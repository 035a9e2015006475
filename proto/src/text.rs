//! Text scanning shared by the worker (thinking budgets) and the control plane (output
//! parsing): both read markers out of output that arrives cut anywhere.

/// The length of the longest end of `text` that is a proper start of `marker`: what
/// must be held back until more text shows whether it is the marker.
pub fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::partial_suffix;

    #[test]
    fn only_a_proper_start_of_the_marker_is_held() {
        assert_eq!(partial_suffix("abc</th", "</think>"), 4);
        assert_eq!(partial_suffix("abc<", "</think>"), 1);
        assert_eq!(partial_suffix("abc</think>", "</think>"), 0, "a whole marker is found, not held");
        assert_eq!(partial_suffix("abc", "</think>"), 0);
        assert_eq!(partial_suffix("é", "é!"), 2, "whole characters only");
    }
}
