//! Vocabulary helpers for GGUF tokenizers: GPT-2's byte alphabet and the rebuilding of
//! BPE merges from a vocabulary that has none.

use std::cmp::Ordering;
use std::collections::{HashMap, HashSet};

/// GPT-2's `bytes_to_unicode`: the printable character that stands for each byte.
pub(crate) fn byte_chars() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut chars = ['\0'; 256];
    let mut shifted = 0u32;
    for b in 0..256u32 {
        let code = if printable(b) {
            b
        } else {
            shifted += 1;
            255 + shifted
        };
        // Every code is below 0x180, so it is a valid scalar value.
        chars[b as usize] = char::from_u32(code).unwrap_or('\u{fffd}');
    }
    chars
}

/// The set of characters of GPT-2's byte alphabet.
pub(crate) fn byte_alphabet() -> HashSet<char> {
    byte_chars().into_iter().collect()
}

/// A token as a byte-level vocabulary spells it: unchanged when every character is in
/// the byte alphabet, else each UTF-8 byte replaced by its alphabet character (as
/// transformers' `byte_level_tokenizer` does).
pub(crate) fn respell_byte_level(token: &str, alphabet: &HashSet<char>) -> String {
    if token.chars().all(|c| alphabet.contains(&c)) {
        return token.to_string();
    }
    let chars = byte_chars();
    token.bytes().map(|b| chars[b as usize]).collect()
}

/// One candidate merge: the two halves and what orders it.
struct Candidate<'a> {
    left: &'a str,
    right: &'a str,
    score: f64,
    left_chars: usize,
    right_chars: usize,
}

/// transformers' `generate_merges(vocab, vocab_scores)`: every split of every token
/// into two vocabulary entries, ordered by the token's score (highest first), then by
/// the length of the left and right halves in characters (longest first).
///
/// `tokens[i]` has id `i` and score `scores[i]`. As with the Python dicts, a token that
/// appears twice keeps the id and score of its last appearance and the position of its
/// first. Ties keep their generation order (Python's sort is stable).
pub(crate) fn generate_merges(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let mut ids: HashMap<&str, usize> = HashMap::with_capacity(tokens.len());
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        if ids.insert(t.as_str(), i).is_none() {
            order.push(t.as_str());
        }
    }
    let mut merges: Vec<Candidate> = Vec::new();
    let mut local: Vec<(usize, usize, Candidate)> = Vec::new();
    for token in order {
        let Some(score) = ids.get(token).and_then(|&i| scores.get(i)).copied() else {
            continue;
        };
        local.clear();
        let num_chars = token.chars().count();
        for (left_chars, (at, _)) in token.char_indices().enumerate().skip(1) {
            let (left, right) = token.split_at(at);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                let right_chars = num_chars - left_chars;
                let c = Candidate {
                    left,
                    right,
                    score,
                    left_chars,
                    right_chars,
                };
                local.push((l, r, c));
            }
        }
        local.sort_by_key(|&(l, r, _)| (l, r));
        merges.extend(local.drain(..).map(|(_, _, c)| c));
    }
    merges.sort_by(|a, b| {
        let by_score = b.score.partial_cmp(&a.score).unwrap_or(Ordering::Equal);
        by_score
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    merges
        .into_iter()
        .map(|c| (c.left.to_string(), c.right.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_matches_gpt2() {
        let chars = byte_chars();
        assert_eq!(chars[b'!' as usize], '!');
        assert_eq!(chars[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(chars[b'\n' as usize], '\u{10a}'); // Ċ
        assert_eq!(chars[0xad], '\u{143}');
        assert_eq!(byte_alphabet().len(), 256);
    }

    #[test]
    fn respelling_keeps_alphabet_tokens() {
        let alphabet = byte_alphabet();
        assert_eq!(respell_byte_level("Ġworld", &alphabet), "Ġworld");
        assert_eq!(respell_byte_level("é ", &alphabet), "Ã©Ġ");
    }

    #[test]
    fn merges_follow_score_then_left_length() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "abc", "bc"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let scores: Vec<f64> = (0..tokens.len()).map(|i| -(i as f64)).collect();
        let merges = generate_merges(&tokens, &scores);
        let pairs: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(pairs, [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]);
    }
}
