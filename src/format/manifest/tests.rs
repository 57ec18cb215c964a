//! Unit tests of the manifest's encoding, decoding and validation rules.

use super::*;
use crate::dtype::DType;

pub(crate) fn sample() -> Manifest {
    Manifest {
        format: FORMAT_NAME.into(),
        version: VERSION,
        features: vec![],
        checkpoint_id: "0123456789abcdef0123456789abcdef".into(),
        shards: vec![ShardEntry {
            file: "s0.safetensors".into(),
            size: 8 + 64 + 12,
            header_size: 64,
            header_crc32: 7,
        }],
        tensors: vec![
            TensorInfo {
                name: "a".into(),
                shard: 0,
                dtype: DType::F32,
                shape: vec![2],
                offsets: [72, 80],
                crc32: Some(1),
                absmax: None,
                blocks: None,
            },
            TensorInfo {
                name: "b".into(),
                shard: 0,
                dtype: DType::I32,
                shape: vec![],
                offsets: [80, 84],
                crc32: Some(2),
                absmax: None,
                blocks: None,
            },
        ],
        metadata: serde_json::json!({"step": 3}),
        optimizer: None,
        globals: Vec::new(),
        parts: Vec::new(),
        grids: Vec::new(),
    }
}

#[test]
fn round_trip_with_trailer() {
    let m = sample();
    let bytes = encode(&m);
    assert!(bytes.ends_with(b"\"}\n"));
    assert_eq!(decode(&bytes).unwrap(), m);
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert!(v["manifest_crc32"].is_string());
}

#[test]
fn every_bit_flip_is_rejected() {
    let bytes = encode(&sample());
    for i in 0..bytes.len() * 8 {
        let mut b = bytes.clone();
        b[i / 8] ^= 1 << (i % 8);
        assert!(decode(&b).is_err(), "flip of bit {i} accepted");
    }
}

#[test]
fn rejects_bad_contents() {
    type Edit = fn(&mut Manifest);
    let cases: Vec<(Edit, &str)> = vec![
        (|m| m.shards[0].file = "../x".into(), "plain file name"),
        (
            |m| m.shards[0].file = "/etc/passwd".into(),
            "plain file name",
        ),
        (|m| m.shards[0].file = "a\0b".into(), "plain file name"),
        (|m| m.tensors[1].name = "a".into(), "listed twice"),
        (|m| m.tensors[1].offsets = [76, 80], "overlap"),
        (
            |m| {
                m.shards[0].size = 96;
                m.tensors[1].offsets = [82, 86]
            },
            "multiple",
        ),
        (|m| m.tensors[0].offsets = [0, 8], "data section"),
        (|m| m.tensors[0].shard = 5, "out of range"),
        (|m| m.tensors[0].shape = vec![u64::MAX, 4], "overflows"),
        (|m| m.checkpoint_id = "xyz".into(), "checkpoint_id"),
        (|m| m.shards.push(m.shards[0].clone()), "listed twice"),
    ];
    for (f, want) in cases {
        let mut m = sample();
        f(&mut m);
        match decode(&encode(&m)) {
            Err(DecodeError::Invalid(r)) => assert!(r.contains(want), "{want:?} not in {r:?}"),
            other => panic!("expected Invalid({want}), got {other:?}"),
        }
    }
    let mut m = sample();
    m.version = 2;
    assert!(matches!(decode(&encode(&m)), Err(DecodeError::Version(2))));
    let mut m = sample();
    m.features = vec!["ranks".into()];
    assert!(matches!(decode(&encode(&m)), Err(DecodeError::Feature(f)) if f == "ranks"));
}

#[test]
fn invalid_utf8_in_an_unknown_member_is_refused() {
    let mut body = serde_json::to_vec(&sample()).unwrap();
    body.pop();
    for bad in [&b"\xff"[..], b"\xc3", b"\xed\xa0\x80"] {
        let mut b = body.clone();
        b.extend_from_slice(b",\"x\":\"");
        b.extend_from_slice(bad);
        b.push(b'"');
        match decode(&append_trailer(b)) {
            Err(DecodeError::Invalid(r)) => assert!(r.contains("not UTF-8"), "{r}"),
            other => panic!("{bad:?} in an unknown member: {other:?}"),
        }
    }
    // The same member with valid UTF-8 is ignored, as unknown members are.
    let mut b = body.clone();
    b.extend_from_slice(",\"x\":\"\u{e9}\"".as_bytes());
    assert_eq!(decode(&append_trailer(b)).unwrap(), sample());
}

/// A manifest using every member: features, absmax, block CRCs (parsed only: they do
/// not fit the tensor), an optimizer section, nested
/// metadata, a non-ASCII tensor name.
fn full_sample() -> Manifest {
    let mut m = sample();
    m.features = vec!["optimizer".into()];
    m.tensors[0].absmax = Some(0.75);
    m.tensors[0].blocks = Some(BlockCrcs {
        size: 4096,
        crc32: vec![0, 4_294_967_295, 7],
    });
    m.tensors[1].name = "é.b".into();
    m.metadata = serde_json::json!({"step": 3, "nested": {"a": [1, 2.5, null, "x\"y"]}});
    m.optimizer = Some(OptimizerSection {
        groups: vec![GroupEntry {
            params: vec!["a".into()],
            hyper: serde_json::json!({"lr": 1e-3, "betas": [0.9, 0.999]}),
        }],
        params: vec![ParamEntry {
            name: "a".into(),
            shape: vec![2],
            state: vec![StateEntry {
                name: "exp_avg".into(),
                tensor: "a".into(),
                encoding: Encoding::F16Scaled,
                scale: Some("b".into()),
            }],
        }],
    });
    m
}

/// What the fast path accepts, serde_json accepts with the same value. Returns
/// whether the fast path accepted.
fn agrees(bytes: &[u8]) -> bool {
    let Some(fast) = fast::parse(bytes) else {
        return false;
    };
    match serde_json::from_slice::<Manifest>(bytes) {
        Ok(slow) => assert_eq!(fast, slow, "{}", String::from_utf8_lossy(bytes)),
        Err(e) => panic!(
            "fast path accepted what serde_json refuses ({e}): {}",
            String::from_utf8_lossy(bytes)
        ),
    }
    true
}

#[test]
fn fast_path_takes_what_writers_write() {
    for m in [sample(), full_sample()] {
        let bytes = encode(&m);
        assert_eq!(fast::parse(&bytes).as_ref(), Some(&m));
        assert!(agrees(&bytes));
        // Indented, and members in reverse order: still the fast path's.
        let pretty = serde_json::to_vec_pretty(&m).unwrap();
        assert!(agrees(&pretty));
        let v = serde_json::to_value(&m).unwrap();
        let mut rev = serde_json::Map::new();
        for (k, v) in v.as_object().unwrap().iter().rev() {
            let v = match v.as_array() {
                Some(a) => a
                    .iter()
                    .map(|e| match e.as_object() {
                        Some(o) => serde_json::Value::Object(o.clone().into_iter().rev().collect()),
                        None => e.clone(),
                    })
                    .collect(),
                None => v.clone(),
            };
            rev.insert(k.clone(), v);
        }
        let rev = serde_json::to_vec(&rev).unwrap();
        assert!(agrees(&rev), "{}", String::from_utf8_lossy(&rev));
    }
}

#[test]
fn fast_path_agrees_with_serde_on_every_small_edit() {
    let interesting: &[u8] = b"\"\\0019-+.eE {}[],:nul\x00\x1f\x7f\x80\xc3\xff";
    let mut accepted = 0;
    let mut total = 0;
    for m in [sample(), full_sample()] {
        let base = encode(&m);
        for p in 0..=base.len() {
            let mut variants = Vec::new();
            if p < base.len() {
                let mut d = base.clone();
                d.remove(p);
                variants.push(d);
                for &c in interesting {
                    let mut r = base.clone();
                    r[p] = c;
                    variants.push(r);
                }
            }
            for &c in b" \"0,\\}" {
                let mut ins = base.clone();
                ins.insert(p, c);
                variants.push(ins);
            }
            for v in variants {
                total += 1;
                accepted += usize::from(agrees(&v));
            }
        }
    }
    // Not vacuous: many edits (digits changed, whitespace) stay on the fast path.
    assert!(accepted > total / 50, "{accepted} of {total}");
}

#[test]
fn fast_path_agrees_with_serde_on_hostile_members() {
    let head = r#"{"format":"ckptstore","version":1,"checkpoint_id":"0123456789abcdef0123456789abcdef","shards":[{"file":"s0","size":84,"header_size":64,"header_crc32":7}],"tensors":["#;
    let tail = r#"],"metadata":{},"manifest_crc32":"00000000"}"#;
    let tensor = |members: &str| format!(r#"{head}{{{members}}}{tail}"#);
    let ok = r#""name":"a","shard":0,"dtype":"F32","shape":[2],"offsets":[72,80],"crc32":1"#;
    let mut cases: Vec<String> = vec![tensor(ok)];
    for (from, to) in [
        (r#""crc32":1"#, r#""crc32":null"#),
        (r#""crc32":1"#, r#""crc32":4294967295"#),
        (r#""crc32":1"#, r#""crc32":4294967296"#),
        (r#""crc32":1"#, r#""crc32":-1"#),
        (r#""crc32":1"#, r#""crc32":1.0"#),
        (r#""crc32":1"#, r#""crc32":1e0"#),
        (r#""crc32":1"#, r#""crc32":01"#),
        (r#""crc32":1"#, r#""crc32":"1""#),
        (r#""crc32":1"#, r#""crc32":1,"crc32":1"#),
        (r#""crc32":1"#, r#""crc32":1,"absmax":null"#),
        (r#""crc32":1"#, r#""crc32":1,"x":{"y":[1,{"z":"\"]}"}]}"#),
        (r#""crc32":1"#, r#""crc32":1,"x":nul"#),
        (r#""crc32":1"#, r#""crc32":1,"x":[1,]"#),
        (r#""crc32":1"#, r#""crc32":1,"x":"\u0041""#),
        (r#""crc32":1"#, r#""crc32":1,"#),
        (r#""crc32":1"#, ""),
        (r#""shard":0"#, r#""shard":18446744073709551615"#),
        (r#""shard":0"#, r#""shard":18446744073709551616"#),
        (r#""shard":0"#, r#""shard":99999999999999999999"#),
        (r#""shard":0"#, r#""shard":00000000000000000000000"#),
        (r#""shard":0"#, r#""shard":-0"#),
        (r#""offsets":[72,80]"#, r#""offsets":[72,80,88]"#),
        (r#""offsets":[72,80]"#, r#""offsets":[72]"#),
        (r#""offsets":[72,80]"#, r#""offsets":[ 72 , 80 ]"#),
        (r#""shape":[2]"#, r#""shape":[]"#),
        (r#""shape":[2]"#, r#""shape":[1,2,3,4,5,6,7,8,9,10,11,12]"#),
        (r#""shape":[2]"#, r#""shape":[2,]"#),
        (r#""shape":[2]"#, r#""shape":null"#),
        (r#""dtype":"F32""#, r#""dtype":"F8_E4M3""#),
        (r#""dtype":"F32""#, r#""dtype":"BOOL""#),
        (r#""dtype":"F32""#, r#""dtype":"F\u0033\u0032""#),
        (r#""name":"a""#, r#""name":"a\"b""#),
        (r#""name":"a""#, r#""name":"a\u0000""#),
        (r#""name":"a""#, r#""name":"tab	x""#),
        (r#""name":"a""#, r#""name":"€𝄞""#),
        (r#""name":"a""#, r#""name":"a","name":"b""#),
        (r#""name":"a""#, r#""na\u006de":"a""#),
        (r#""name":"a","#, ""),
    ] {
        cases.push(tensor(&ok.replace(from, to)));
    }
    // A struct written as an array, which serde_json also accepts.
    cases.push(format!(r#"{head}["a",0,"F32",[2],[72,80],1]{tail}"#));
    // absmax: accepted values as serde_json writes them, and everything else.
    let mut absmax: Vec<String> = "0 0.0 -0.0 -0 5 1E0 1e-3 0.5 0.1 1.5e-3 3.0e38 \
        3.4028234663852886e38 3.5e38 1e400 1e-400 1. .5 01.5 0.5e 0.5e+ 1e+2 null \"1\" \
        16777217 16777216 9007199254740993 0.000000000000000000000000000000000000000000001 \
        1.00000000000000000000000000000000001"
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for _ in 0..3000 {
        let f = f32::from_bits(next() as u32);
        absmax.push(serde_json::to_string(&f64::from(f)).unwrap_or_default());
        // Random decimals, some exact in FP32, most not.
        let digits = |n: u64, next: &mut dyn FnMut() -> u64| -> String {
            (0..n)
                .map(|_| char::from(b'0' + (next() % 10) as u8))
                .collect()
        };
        let r = next();
        let mut t = digits(1 + r % 12, &mut next);
        if r & 1 << 8 != 0 {
            t = format!("{t}.{}", digits(1 + (r >> 9) % 22, &mut next));
        }
        if r & 1 << 16 != 0 {
            t = format!(
                "{t}e{}{}",
                ["", "+", "-"][(r >> 17) as usize % 3],
                (r >> 20) % 60
            );
        }
        absmax.push(t);
    }
    let fp32 = ok.replace(r#""crc32":1"#, r#""crc32":1,"absmax":X"#);
    let mut accepted = 0;
    for a in &absmax {
        let doc = tensor(&fp32.replace('X', a));
        accepted += usize::from(agrees(doc.as_bytes()));
    }
    assert!(accepted > 1000, "{accepted}");
    // Nesting around the limits of serde_json (128) and of the fast path (64).
    for depth in [63, 64, 65, 126, 127, 128, 129] {
        let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        cases.push(format!(
            r#"{head}{{{ok}}}],"metadata":{{"x":{nested}}},"manifest_crc32":"00000000"}}"#
        ));
        cases.push(format!(r#"{head}{{{ok},"x":{nested}}}{tail}"#));
    }
    let mut accepted = 0;
    for c in &cases {
        accepted += usize::from(agrees(c.as_bytes()));
    }
    assert!(accepted > 10, "{accepted}");
}

#[test]
fn uint_matches_a_digit_loop() {
    let naive = |s: &[u8]| -> Option<(u64, usize)> {
        let n = s.iter().take_while(|c| c.is_ascii_digit()).count();
        let v = s[..n].iter().try_fold(0u64, |v, &c| {
            v.checked_mul(10)?.checked_add(u64::from(c - b'0'))
        })?;
        Some((v, n))
    };
    let mut seed = 12345u64;
    for len in 0..26 {
        for _ in 0..200 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut s: Vec<u8> = (0..len)
                .map(|k| b'0' + ((seed >> (k % 16 * 4)) % 10) as u8)
                .collect();
            if seed & 1 == 0 {
                s.push([b',', b']', b'}', b'/', b':', b' ', b'.'][(seed >> 40) as usize % 7]);
                s.extend_from_slice(b"123456789");
            }
            assert_eq!(fast::uint(&s), naive(&s), "{}", String::from_utf8_lossy(&s));
        }
    }
    for s in [
        "18446744073709551615",
        "18446744073709551616",
        "99999999999999999999",
    ] {
        assert_eq!(fast::uint(s.as_bytes()), naive(s.as_bytes()), "{s}");
    }
}
