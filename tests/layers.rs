//! The crate's floors (lib.rs §Modules): every `crate::` path in the code of a module names a
//! module on its own floor or below (siblings on floor 4 and 6 never import each other), and
//! root re-exports count as the module they come from. Comments and doc links are not
//! imports; `#[cfg(test)]` code is held to the same rule.

#[path = "common/files.rs"]
mod files;

use std::collections::BTreeMap;
use std::path::Path;

use files::rs_files;

/// Floor of each top-level module; `None` for names that are not modules (root re-exports
/// are resolved through [`reexport`]).
fn floor(m: &str) -> Option<u32> {
    Some(match m {
        "error" | "location" | "dtype" | "view" | "tensor" | "crc" | "sys" | "mmap" | "convert" => {
            1
        }
        "format" => 2,
        "store" => 3,
        "write" | "checkpoint" => 4,
        "optim" => 5,
        "manager" | "api" => 6,
        _ => return None,
    })
}

/// The module a root re-export comes from (lib.rs `pub use`).
fn reexport(name: &str) -> Option<&'static str> {
    Some(match name {
        "open" | "save" | "write_part" | "commit" | "discard" => "api",
        "Checkpoint" | "Region" | "TensorInfo" | "VerifyReport" | "Storage" => "checkpoint",
        "Error" | "Result" => "error",
        "BufferPool" | "Tensor" | "DType" | "Element" | "TensorView" => "tensor",
        "CommitOptions" | "Part" | "PartItem" | "Cleanup" | "CommitInfo" | "SaveOptions"
        | "TensorRef" => "write",
        _ => return None,
    })
}

/// The `crate::` paths of `code` (comments removed): the first segment, and the second
/// where the first is a root re-export's name.
fn crate_refs(code: &str) -> Vec<String> {
    let mut refs = Vec::new();
    for line in code.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            let before = rest[..i].chars().last();
            rest = &rest[i + "crate::".len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue; // `ckptstore::crate::` cannot occur; `foocrate::` is not ours
            }
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a, b::c}`: each first segment (one line's worth).
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let seg: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !seg.is_empty() {
                        refs.push(seg);
                    }
                }
                continue;
            }
            let seg: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            refs.push(seg);
        }
    }
    refs
}

#[test]
fn every_module_imports_only_its_floor_and_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut broken: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut checked = 0;
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let top = top.trim_end_matches(".rs").to_string();
        if top == "lib" || top == "bin" {
            continue;
        }
        let Some(own) = floor(&top) else {
            panic!(
                "src/{} is in module {top:?}, which has no floor here: add it",
                rel.display()
            );
        };
        // (`super::` paths stay inside the top-level module: a module's root file that
        // reached the crate root with `use super::` would be missed, and none does.)
        let code = std::fs::read_to_string(f).unwrap();
        for r in crate_refs(&code) {
            let m = reexport(&r).map(str::to_string).unwrap_or(r.clone());
            let Some(theirs) = floor(&m) else {
                panic!(
                    "src/{}: crate::{r} is neither a module nor a known root re-export",
                    rel.display()
                );
            };
            checked += 1;
            let sibling = theirs == own && m != top && matches!(own, 4 | 6);
            if theirs > own || sibling {
                broken
                    .entry(format!("src/{}", rel.display()))
                    .or_default()
                    .push(format!(
                        "crate::{r} ({m}, floor {theirs}; this file is floor {own})"
                    ));
            }
        }
    }
    assert!(
        checked > 200,
        "only {checked} crate:: paths found: is the scan broken?"
    );
    assert!(broken.is_empty(), "imports against the floors: {broken:#?}");
}

#[test]
fn the_scan_sees_imports_and_skips_comments() {
    let code = "use crate::store::Store;\n/// [`crate::api::open`]\nlet x = crate::open(p); // crate::manager\nuse crate::{format::names, error::Error};\n";
    assert_eq!(crate_refs(code), ["store", "open", "format", "error"]);
}
