//! The subject common name (CN) of a client certificate: the name a mutual-TLS client is known by
//! in the `allow` list (`client = "CN"`), as a token's name is for a bearer-token client.
//!
//! Only certificates rustls has already verified against `--tls-client-ca` reach this code, but
//! it still treats the bytes as untrusted: a minimal DER walk with every length checked against
//! what is left, no recursion, no allocation but the returned name, and `None` for anything it
//! does not understand (the client is then anonymous, never someone else).

/// OID 2.5.4.3 (id-at-commonName), DER-encoded with its tag and length.
const CN_OID: [u8; 5] = [0x06, 0x03, 0x55, 0x04, 0x03];
const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
/// `[0] EXPLICIT Version` at the start of a v3 TBSCertificate.
const VERSION: u8 = 0xa0;
/// Longest name taken from a certificate; longer ones are not names an operator writes.
const MAX_NAME: usize = 256;

/// One DER element: (tag, contents, what follows). Single-byte tags only (all X.509 needs here).
fn tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// The subject's common name of a DER certificate (the last CN when there are several, as most
/// tools show it), if it has one that is printable text.
pub fn subject_common_name(der: &[u8]) -> Option<String> {
    let (SEQUENCE, cert, _) = tlv(der)? else { return None };
    let (SEQUENCE, tbs, _) = tlv(cert)? else { return None };
    let mut rest = tbs;
    let (tag, _, after) = tlv(rest)?;
    if tag == VERSION {
        rest = after;
    }
    // serialNumber, signature, issuer, validity: skipped; then the subject.
    for _ in 0..4 {
        rest = tlv(rest)?.2;
    }
    let (SEQUENCE, mut rdns, _) = tlv(rest)? else { return None };
    let mut found = None;
    while !rdns.is_empty() {
        let (SET, mut attrs, next) = tlv(rdns)? else { return None };
        rdns = next;
        while !attrs.is_empty() {
            let (SEQUENCE, attr, next) = tlv(attrs)? else { return None };
            attrs = next;
            if let Some(value) = attr.strip_prefix(&CN_OID[..]) {
                let (_, text, _) = tlv(value)?;
                found = Some(text);
            }
        }
    }
    let text = std::str::from_utf8(found?).ok()?;
    (!text.is_empty() && text.len() <= MAX_NAME && text.chars().all(|c| !c.is_control())).then(|| text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn el(tag: u8, content: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        match content.len() {
            n if n < 0x80 => out.push(n as u8),
            n if n < 0x100 => out.extend([0x81, n as u8]),
            n => out.extend([0x82, (n >> 8) as u8, n as u8]),
        }
        out.extend_from_slice(content);
        out
    }

    fn name(attrs: &[(&[u8], &str)]) -> Vec<u8> {
        let rdns: Vec<u8> = attrs
            .iter()
            .flat_map(|(oid, v)| el(SET, &el(SEQUENCE, &[*oid, &el(0x0c, v.as_bytes())[..]].concat())))
            .collect();
        el(SEQUENCE, &rdns)
    }

    fn cert(version: bool, subject: &[u8]) -> Vec<u8> {
        let mut tbs = Vec::new();
        if version {
            tbs.extend(el(VERSION, &el(0x02, &[2])));
        }
        tbs.extend(el(0x02, &[1, 2, 3])); // serial
        tbs.extend(el(SEQUENCE, &el(0x06, &[0x2a, 0x86]))); // signature algorithm
        tbs.extend(name(&[(&CN_OID, "issuer-ca")])); // issuer
        tbs.extend(el(SEQUENCE, &[el(0x17, b"260101000000Z"), el(0x17, b"270101000000Z")].concat()));
        tbs.extend_from_slice(subject);
        tbs.extend(el(SEQUENCE, &[0; 200])); // a public key, long enough for a 2-byte length
        el(SEQUENCE, &[el(SEQUENCE, &tbs), el(SEQUENCE, &[]), el(0x03, &[0])].concat())
    }

    const OU: [u8; 5] = [0x06, 0x03, 0x55, 0x04, 0x0b];

    #[test]
    fn finds_the_subject_cn_not_the_issuers() {
        let subject = name(&[(&OU, "ml"), (&CN_OID, "trainer-a")]);
        assert_eq!(subject_common_name(&cert(true, &subject)).as_deref(), Some("trainer-a"));
        assert_eq!(subject_common_name(&cert(false, &subject)).as_deref(), Some("trainer-a"));
        assert_eq!(subject_common_name(&cert(true, &name(&[(&OU, "ml")]))), None, "no CN: anonymous");
    }

    #[test]
    fn malformed_input_is_none_never_a_panic() {
        let good = cert(true, &name(&[(&CN_OID, "trainer-a")]));
        for cut in 0..good.len() {
            assert_eq!(subject_common_name(&good[..cut]), None, "truncated at {cut}");
        }
        for i in 0..good.len() {
            for b in [0x00, 0x7f, 0x80, 0x84, 0xff] {
                let mut bad = good.clone();
                bad[i] = b;
                let _ = subject_common_name(&bad);
            }
        }
        assert_eq!(subject_common_name(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(subject_common_name(&cert(true, &name(&[(&CN_OID, "a\nb")]))), None, "control characters");
    }
}
