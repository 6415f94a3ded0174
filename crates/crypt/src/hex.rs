//! Lower-case hex, enough for key files and wrapped keys (no dependency).

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Appends the lower-case hex form of `bytes` to `out`.
pub(crate) fn encode_into(bytes: &[u8], out: &mut String) {
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    encode_into(bytes, &mut s);
    s
}

fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// Decodes `text` (either case) into exactly `out.len()` bytes. Returns
/// `false`, with `out` partly written, if the length or a digit is wrong.
pub(crate) fn decode_into(text: &[u8], out: &mut [u8]) -> bool {
    if text.len() != out.len() * 2 {
        return false;
    }
    for (o, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        match (nibble(pair[0]), nibble(pair[1])) {
            (Some(hi), Some(lo)) => *o = (hi << 4) | lo,
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_rejects() {
        let bytes: Vec<u8> = (0..=255).collect();
        let text = encode(&bytes);
        assert_eq!(&text[..8], "00010203");
        let mut back = vec![0u8; 256];
        assert!(decode_into(text.as_bytes(), &mut back));
        assert_eq!(back, bytes);
        assert!(decode_into(text.to_uppercase().as_bytes(), &mut back));
        assert_eq!(back, bytes);

        let mut two = [0u8; 2];
        assert!(!decode_into(b"abc", &mut two));
        assert!(!decode_into(b"abcdef", &mut two));
        assert!(!decode_into(b"ab g", &mut two));
        assert!(!decode_into(b"+1ab", &mut two));
    }
}
