//! The WebDataset grouping rule: which member path belongs to which sample (key) under which
//! field, and how fields are normalised (lower-cased) as the `webdataset` library does.

use std::borrow::Cow;

/// Splits a member path into `(key, field)` by the WebDataset rule (the field as written, before
/// lower-casing); None for members that belong to no sample.
pub fn split_key(path: &str) -> Option<(&str, &str)> {
    if is_metadata(path) {
        return None;
    }
    let name_start = path.rfind('/').map_or(0, |slash| slash + 1);
    let dot = path.get(name_start..)?.find('.')?;
    if dot == 0 {
        return None; // ".hidden": no key
    }
    let key_end = name_start + dot;
    let field = path.get(key_end + 1..)?;
    if field.is_empty() {
        return None; // "abc.": no field to select it by
    }
    Some((path.get(..key_end)?, field))
}

/// WebDataset's metadata members (`skip_meta = r"__[^/]*__($|/)"`): a first path component
/// that starts and ends with `__`.
pub(super) fn is_metadata(path: &str) -> bool {
    let first = path.split('/').next().unwrap_or(path);
    first.len() >= 4 && first.starts_with("__") && first.ends_with("__")
}

/// Lower-cases a field as `webdataset` does (`suffix.lower()`), allocating only when it changes.
pub(super) fn normalize_field(field: Cow<'_, str>) -> Cow<'_, str> {
    if field.is_ascii() {
        if field.bytes().any(|b| b.is_ascii_uppercase()) { Cow::Owned(field.to_ascii_lowercase()) } else { field }
    } else {
        let lower = field.to_lowercase();
        if lower == *field { field } else { Cow::Owned(lower) }
    }
}

/// [`split_key`] on a name that may own its string: borrowed parts stay borrowed.
pub(super) fn split_name(name: Cow<'_, str>) -> Option<(Cow<'_, str>, Cow<'_, str>)> {
    match name {
        Cow::Borrowed(n) => split_key(n).map(|(k, f)| (Cow::Borrowed(k), Cow::Borrowed(f))),
        Cow::Owned(mut n) => {
            let (key_len, field) = split_key(&n).map(|(k, f)| (k.len(), f.to_owned()))?;
            n.truncate(key_len);
            Some((Cow::Owned(n), Cow::Owned(field)))
        }
    }
}
