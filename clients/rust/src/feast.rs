//! The string key of a Feast feature view keyed by several entities (a
//! composite key) as a Quiver server with `[feast]` serves it
//! (docs/FEATURES.md, "Feast"), so a caller names `{user_id, merchant_id}`
//! as it names them to Feast and never spells the canonical text by hand.
//! The server derives the same text from Feast's Redis keys
//! (`features::feast::redis_layout::composite_text`); both follow one rule:
//! the values in the order of their join keys' names (ascending bytes, as
//! Feast serializes them), joined by `|`, an integer in signed decimal, a
//! string with `|` and `\` escaped by a `\`.

/// One join key's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeastValue<'a> {
    Int(i64),
    Str(&'a str),
}

/// The longest string key a group accepts (the replica format's limit).
pub const KEY_BYTES_MAX: usize = 64;

/// Why an entity row has no composite key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeastKeyError {
    /// Fewer than two join keys: a view of one entity is keyed by its value itself.
    NotComposite(usize),
    /// A join key named twice.
    Duplicate(String),
    /// The text is longer than a string key may be.
    TooLong(usize),
}

impl std::fmt::Display for FeastKeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FeastKeyError::NotComposite(n) => write!(
                f,
                "{n} join key(s): a composite key has two or more (a view of one entity is keyed by its value)"
            ),
            FeastKeyError::Duplicate(k) => write!(f, "join key '{k}' named twice"),
            FeastKeyError::TooLong(n) => write!(f, "the key is {n} bytes, past the {KEY_BYTES_MAX} a string key holds"),
        }
    }
}

impl std::error::Error for FeastKeyError {}

/// The composite key of the entity row `row` (join key, value; any order),
/// e.g. `[("user_id", Int(23758)), ("merchant_id", Str("m-1"))]` is `m-1|23758`.
pub fn feast_key(row: &[(&str, FeastValue<'_>)]) -> Result<String, FeastKeyError> {
    if row.len() < 2 {
        return Err(FeastKeyError::NotComposite(row.len()));
    }
    let mut sorted: Vec<&(&str, FeastValue<'_>)> = row.iter().collect();
    sorted.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    if let Some(w) = sorted.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(FeastKeyError::Duplicate(w[0].0.to_string()));
    }
    let mut out = String::new();
    for (i, (_, value)) in sorted.iter().enumerate() {
        if i > 0 {
            out.push('|');
        }
        match value {
            FeastValue::Int(x) => out.push_str(&x.to_string()),
            FeastValue::Str(s) => {
                for c in s.chars() {
                    if c == '|' || c == '\\' {
                        out.push('\\');
                    }
                    out.push(c);
                }
            }
        }
    }
    if out.len() > KEY_BYTES_MAX {
        return Err(FeastKeyError::TooLong(out.len()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_the_servers_canonical_text() {
        use FeastValue::{Int, Str};
        assert_eq!(feast_key(&[("user_id", Int(23758)), ("merchant_id", Str("m-1"))]).unwrap(), "m-1|23758");
        assert_eq!(feast_key(&[("user_id", Int(-5)), ("merchant_id", Str("m-é|x\\"))]).unwrap(), "m-é\\|x\\\\|-5");
        assert_eq!(feast_key(&[("shop", Int(7)), ("user_id", Int(23758)), ("b", Str(""))]).unwrap(), "|7|23758");
        assert_eq!(feast_key(&[("a", Int(1))]), Err(FeastKeyError::NotComposite(1)));
        assert_eq!(feast_key(&[("a", Int(1)), ("a", Int(2))]), Err(FeastKeyError::Duplicate("a".into())));
        let long = "x".repeat(63);
        assert_eq!(feast_key(&[("a", Str(&long)), ("b", Int(1))]), Err(FeastKeyError::TooLong(65)));
    }
}
