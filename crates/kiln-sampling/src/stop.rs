//! Stop strings over streamed text.
//!
//! Detokenized text arrives in deltas whose boundaries have nothing to do with stop
//! strings, so a stop string may begin in one delta and end several deltas later. The
//! [`StopMatcher`] holds back any tail that could still grow into a stop string and
//! releases it as soon as it cannot.
//!
//! # Semantics
//!
//! Treat the concatenation of all deltas as one text `T`. A stop string `s` occurs at
//! `[start, start + len(s))` if `T` has `s` there. The match that ends generation is
//! the occurrence with the smallest end; among those with the same end, the one with
//! the smallest start (the longest); then the lowest index in the stop list. The
//! emitted text is `T[..start]` of that match, or all of `T` (after `finish`) if
//! nothing matched. This depends only on `T`, never on where the deltas split it,
//! and it is what one would see checking after every single character.
//!
//! Matching is on bytes. Deltas are `&str`, so they split only at character
//! boundaries, and because UTF-8 is self-synchronizing a match of a valid stop string
//! always starts and ends on character boundaries, so nothing emitted is ever a
//! partial character.

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text that is safe to emit now: it cannot be part of a stop string.
    pub text: String,
    /// The index in the stop list of the stop string that just matched, if one did.
    /// `text` then ends right before the match, and generation should end with
    /// [`crate::FinishReason::StopString`].
    pub stop_idx: Option<usize>,
}

/// Finds stop strings in streamed text and withholds them from the output.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// The stop strings in request order; empty strings never match.
    stops: Vec<String>,
    /// The longest stop string, in bytes.
    max_stop_len: usize,
    /// Received text not yet released: a possible beginning of a stop string.
    held: String,
    /// The stop that matched, after which nothing more is released.
    stopped: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops`, whose indices are the ones reported in
    /// [`StopOutput::stop_idx`]. Empty strings are ignored (validation rejects them).
    pub fn new<S: AsRef<str>>(stops: &[S]) -> Self {
        let stops: Vec<String> = stops.iter().map(|s| s.as_ref().to_owned()).collect();
        let max_stop_len = stops.iter().map(String::len).max().unwrap_or(0);
        StopMatcher {
            stops,
            max_stop_len,
            held: String::new(),
            stopped: None,
        }
    }

    /// The index of the stop string that matched, if one has.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// The text currently held back because it could begin a stop string.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Feeds the next piece of generated text and returns what may be emitted now.
    ///
    /// After a stop string has matched, every further call returns an empty output.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped.is_some() {
            return StopOutput::default();
        }
        self.held.push_str(delta);
        if let Some((start, stop_idx)) = self.first_match() {
            self.held.truncate(start);
            self.stopped = Some(stop_idx);
            return StopOutput {
                text: std::mem::take(&mut self.held),
                stop_idx: Some(stop_idx),
            };
        }
        let hold_from = self.hold_from();
        let rest = self.held.split_off(hold_from);
        StopOutput {
            text: std::mem::replace(&mut self.held, rest),
            stop_idx: None,
        }
    }

    /// Releases the held-back text when generation ends for a reason other than a
    /// stop string (end of sequence, length, cancellation). Returns an empty string
    /// after a stop string matched, because held text then lies after the match.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The start and stop index of the match in `held` that ends first (ties: the
    /// earlier start, then the lower stop index).
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter(|(_, stop)| !stop.is_empty())
            .filter_map(|(stop_idx, stop)| {
                let start = self.held.find(stop.as_str())?;
                Some((start + stop.len(), start, stop_idx))
            })
            .min()
            .map(|(_, start, stop_idx)| (start, stop_idx))
    }

    /// The earliest position from which the rest of `held` is a proper prefix of some
    /// stop string; `held.len()` if there is none. Such a position is always a
    /// character boundary, because stop strings start with a whole character.
    fn hold_from(&self) -> usize {
        let len = self.held.len();
        let earliest = len.saturating_sub(self.max_stop_len.saturating_sub(1));
        (earliest..len)
            .filter(|&i| self.held.is_char_boundary(i))
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|stop| stop.starts_with(tail))
            })
            .unwrap_or(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The independent reference: scan every end position, then every start.
    fn reference(stops: &[&str], text: &str) -> (String, Option<usize>) {
        for end in 1..=text.len() {
            for start in 0..end {
                for (idx, stop) in stops.iter().enumerate() {
                    let hit = !stop.is_empty() && text.as_bytes()[start..end] == *stop.as_bytes();
                    if hit {
                        return (text[..start].to_owned(), Some(idx));
                    }
                }
            }
        }
        (text.to_owned(), None)
    }

    /// Streams `deltas` through a matcher and returns all emitted text and the stop.
    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<usize>) {
        let mut matcher = StopMatcher::new(stops);
        let mut out = String::new();
        let mut stop = None;
        for delta in deltas {
            let step = matcher.push(delta);
            assert!(stop.is_none() || step == StopOutput::default());
            out.push_str(&step.text);
            stop = stop.or(step.stop_idx);
        }
        out.push_str(&matcher.finish());
        (out, stop)
    }

    fn char_boundaries(text: &str) -> Vec<usize> {
        (1..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect()
    }

    /// Checks the whole text, every single character per delta, and every split into
    /// two and three deltas against the reference.
    fn check_all_splits(stops: &[&str], text: &str) {
        let expected = reference(stops, text);
        assert_eq!(run(stops, &[text]), expected, "whole text {text:?}");
        let bounds = char_boundaries(text);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(stops, &chars), expected, "per char {text:?}");
        for &a in &bounds {
            assert_eq!(run(stops, &[&text[..a], &text[a..]]), expected);
            for &b in bounds.iter().filter(|&&b| b > a) {
                let deltas = [&text[..a], &text[a..b], &text[b..]];
                assert_eq!(run(stops, &deltas), expected, "split {deltas:?}");
            }
        }
    }

    #[test]
    fn every_split_gives_the_same_output() {
        let cases: [(&[&str], &str); 10] = [
            (&["STOP"], "Hello world. STOP and more"),
            (&["STOP"], "no stop string in here, ST"),
            (&["abcd", "bc"], "xxabcdyy"),
            (&["abc", "bc"], "xabcx"),
            (&["bc", "abc"], "xabcx"),
            (&["aab"], "aaaab tail"),
            (&["</s>", "<|end|>"], "a </b> <|en <|end|> z"),
            (&["abab"], "abaabababab"),
            (&["日本人", "🙂終"], "naïve 日本語 テキスト🙂終わり"),
            (&["é"], "cafe\u{301} café"),
        ];
        for (stops, text) in cases {
            check_all_splits(stops, text);
        }
    }

    #[test]
    fn overlapping_stops_resolve_by_earliest_end() {
        assert_eq!(run(&["abcd", "bc"], &["xabcdy"]), ("xa".into(), Some(1)));
        assert_eq!(run(&["bc", "abc"], &["xabc"]), ("x".into(), Some(1)));
        assert_eq!(run(&["x", "x"], &["ax"]), ("a".into(), Some(0)));
    }

    #[test]
    fn stop_string_spanning_three_deltas() {
        let mut matcher = StopMatcher::new(&["<|end|>"]);
        assert_eq!(matcher.push("foo <|e").text, "foo ");
        assert_eq!(matcher.held(), "<|e");
        assert_eq!(matcher.push("nd"), StopOutput::default());
        let last = matcher.push("|> bar");
        assert_eq!(
            last,
            StopOutput {
                text: String::new(),
                stop_idx: Some(0)
            }
        );
        assert_eq!(matcher.stopped(), Some(0));
        assert_eq!(matcher.push("more"), StopOutput::default());
        assert_eq!(matcher.finish(), "");
    }

    #[test]
    fn failed_partial_match_is_released() {
        let mut matcher = StopMatcher::new(&["</s>"]);
        assert_eq!(matcher.push("a </").text, "a ");
        let step = matcher.push("b> c");
        assert_eq!(
            step,
            StopOutput {
                text: "</b> c".into(),
                stop_idx: None
            }
        );
        assert_eq!(matcher.finish(), "");
    }

    #[test]
    fn finish_flushes_a_held_prefix() {
        let mut matcher = StopMatcher::new(&["xyz"]);
        assert_eq!(matcher.push("abcxy").text, "abc");
        assert_eq!(matcher.finish(), "xy");
    }

    #[test]
    fn multibyte_prefix_is_held_then_released() {
        let mut matcher = StopMatcher::new(&["日本人"]);
        assert_eq!(matcher.push("テスト日本").text, "テスト");
        assert_eq!(matcher.push("語").text, "日本語");
    }

    #[test]
    fn no_stops_releases_everything_at_once() {
        let mut matcher = StopMatcher::new::<&str>(&[]);
        assert_eq!(matcher.push("abc").text, "abc");
        let mut matcher = StopMatcher::new(&["", "q"]);
        assert_eq!(matcher.push("abc").text, "abc");
    }
}
