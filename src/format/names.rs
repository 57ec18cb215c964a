//! The file-name grammar of a checkpoint directory or prefix (format-spec/durability.md
//! §Names, format-spec/global.md §Parts): the names the engine creates, and recognising
//! them, so that cleanup removes only its own files.

/// Prefix of every temporary file the writer creates (format-spec/durability.md §Names).
pub const TEMP_PREFIX: &str = ".ckpt-tmp-";
/// Name of the writer's lock file inside a checkpoint directory.
pub const LOCK_FILE: &str = ".ckpt-lock";
/// The name of shard `index` of checkpoint `id` (format-spec/durability.md §Names).
pub fn shard_file_name(id: &str, index: usize) -> String {
    format!("shard-{id}-{index:05}.safetensors")
}

/// The name of shard `k` written by rank `rank` for checkpoint `id` (format-spec/global.md
/// §Parts).
pub fn rank_shard_file_name(id: &str, rank: u32, k: usize) -> String {
    format!("shard-{id}-r{rank}-{k}.safetensors")
}

/// The name of the part descriptor of rank `rank` for checkpoint `id` (format-spec/global.md
/// §Parts).
pub fn part_file_name(id: &str, rank: u32) -> String {
    format!("part-{id}-r{rank}.json")
}

/// True for names the engine creates: shard files (of a single-process save or of a rank),
/// part descriptors and temporary files. Only such files are ever removed by cleanup.
pub fn is_engine_file(name: &str) -> bool {
    name.starts_with(TEMP_PREFIX) || engine_file_id(name).is_some()
}

/// True for a part descriptor `part-<id>-r<rank>.json` (format-spec/global.md §Parts): a
/// directory or prefix holding one may be a multi-rank save whose commit is still to come.
pub fn is_part_file(name: &str) -> bool {
    name.starts_with("part-") && engine_file_id(name).is_some()
}

/// A fresh checkpoint id or temporary-name suffix: 32 random lowercase hex digits.
///
/// # Errors
/// [`crate::error::Error::Io`] if the system's random source fails.
pub(crate) fn random_id() -> crate::error::Result<String> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).map_err(|e| {
        crate::error::Error::io("getrandom", "", std::io::Error::other(e.to_string()))
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// `s` is 32 lowercase hex digits (a checkpoint id).
pub(crate) fn is_id(s: &str) -> bool {
    s.len() == 32
        && s.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// `s` is one or more ASCII digits.
fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
}

/// The checkpoint id in the name of an engine file: `shard-<id>-<i>.safetensors` (5 or more
/// digits), `shard-<id>-r<rank>-<k>.safetensors`, `part-<id>-r<rank>.json`, and the
/// temporary files `.ckpt-tmp-shard-<id>-...`, `.ckpt-tmp-part-<id>-...`,
/// `.ckpt-tmp-<id>-...`. `None` for any other name (a temporary file without an id is still
/// an engine file, [`is_engine_file`]).
pub(crate) fn engine_file_id(name: &str) -> Option<&str> {
    if let Some(t) = name.strip_prefix(TEMP_PREFIX) {
        let t = t
            .strip_prefix("shard-")
            .or_else(|| t.strip_prefix("part-"))
            .unwrap_or(t);
        return t
            .get(..32)
            .filter(|id| is_id(id) && t.as_bytes().get(32) == Some(&b'-'));
    }
    if let Some(rest) = name
        .strip_prefix("shard-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    {
        let (id, tail) = (rest.get(..32)?, rest.get(32..)?);
        let tail = tail.strip_prefix('-')?;
        let ok = match tail.strip_prefix('r') {
            Some(rk) => rk
                .split_once('-')
                .is_some_and(|(r, k)| is_digits(r) && is_digits(k)),
            None => tail.len() >= 5 && is_digits(tail),
        };
        return (is_id(id) && ok).then_some(id);
    }
    let rest = name.strip_prefix("part-")?.strip_suffix(".json")?;
    let (id, tail) = (rest.get(..32)?, rest.get(32..)?);
    (is_id(id) && tail.strip_prefix("-r").is_some_and(is_digits)).then_some(id)
}
