//! Which shard a key belongs to: FNV-1a (64 bit) of the key's UTF-8 bytes, modulo the number of
//! shards. Stable across processes, versions and platforms (unlike std's randomly keyed hasher),
//! so every replica, and every binder, computes the same shard for a key.

/// FNV-1a 64-bit offset basis.
const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// The FNV-1a 64-bit hash of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(PRIME))
}

/// The shard of `key` among `shards` (`None` when there are no shards: one owner for all).
pub fn shard_of(key: &str, shards: u32) -> Option<u32> {
    if shards == 0 {
        return None;
    }
    // The remainder is below `shards`, a u32.
    Some(u32::try_from(fnv1a64(key.as_bytes()) % u64::from(shards)).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_published_vectors() {
        // From the FNV reference test suite.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn shards_are_stable_and_spread() {
        assert_eq!(shard_of("node-1", 0), None);
        assert_eq!(shard_of("node-1", 1), Some(0));
        // Fixed vectors: changing the hash would move every node to another shard.
        assert_eq!(shard_of("node-1", 16), Some((fnv1a64(b"node-1") % 16) as u32));
        assert_eq!(shard_of("", 16), Some(5)); // 0xcbf29ce484222325 % 16 = 5
        assert_eq!(shard_of("a", 16), Some(12)); // 0xaf63dc4c8601ec8c % 16 = 12
        let mut counts = [0u32; 8];
        for i in 0..800 {
            counts[shard_of(&format!("node-{i}"), 8).unwrap() as usize] += 1;
        }
        assert!(counts.iter().all(|c| (60..=140).contains(c)), "uneven: {counts:?}");
    }
}
