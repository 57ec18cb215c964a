//! Shard header parser: `header::parse` must never panic, and whatever it accepts must
//! survive `header::emit` (the writer's encoder) unchanged: same tensors, same metadata.
#![no_main]

use std::path::PathBuf;

use ckptstore::format::header;
use ckptstore::Checkpoint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(h) = header::parse(data) else {
        return;
    };
    let data_start = usize::try_from(h.data_start()).expect("data start inside the input");
    assert!(data_start <= data.len());
    let section = &data[data_start..];

    // Oracle 1: emit, then parse again over the original data section.
    let emitted = header::emit(&h.tensors, &h.metadata);
    assert_eq!(
        emitted.len() % 8,
        0,
        "emit must pad the header to a multiple of 8"
    );
    let mut file = emitted.clone();
    file.extend_from_slice(section);
    let h2 = match header::parse(&file) {
        Ok(h2) => h2,
        Err(e) => panic!("re-emitted header does not parse: {e}\noriginal: {h:?}"),
    };
    assert_eq!(h2.tensors, h.tensors, "tensors changed through emit");
    assert_eq!(h2.metadata, h.metadata, "metadata changed through emit");
    assert_eq!(h2.header_size as usize, emitted.len() - 8);
    // Emitting is deterministic: the re-parsed header emits the same bytes.
    assert_eq!(header::emit(&h2.tensors, &h2.metadata), emitted);

    // Oracle 2: a file whose header parses opens as a plain safetensors checkpoint, and
    // every tensor's view covers exactly its byte range.
    let ck = match Checkpoint::from_safetensors(PathBuf::from("fuzz.safetensors"), data.to_vec()) {
        Ok(ck) => ck,
        Err(e) => panic!("header parses but from_safetensors fails: {e}"),
    };
    assert_eq!(ck.tensors().len(), h.tensors.len());
    assert!(ck.read("\0absent").view_unchecked().is_err());
    for (info, e) in ck.tensors().iter().zip(&h.tensors) {
        assert_eq!(info.name, e.name);
        assert_eq!(ck.info(&e.name).expect("listed tensor"), info);
        let v = ck.read(&info.name).view_unchecked().expect("listed tensor");
        assert_eq!(
            v.bytes().len() as u64,
            e.data_offsets[1] - e.data_offsets[0]
        );
        assert_eq!(
            v.bytes(),
            &section[e.data_offsets[0] as usize..e.data_offsets[1] as usize]
        );
    }
    let report = ck
        .verify()
        .expect("verify of a plain safetensors file checks structure only");
    assert!(!report.checksummed);
});
