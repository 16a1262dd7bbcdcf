//! Known answers: NIST's ACVP vectors for ML-KEM-768 (key generation, encapsulation, and
//! decapsulation of valid and modified ciphertexts), through this module's own types.

use serde_json::Value;

use super::kem::{decapsulate_expanded, encapsulate_with, expanded_decaps_key};
use super::*;

const VECTORS: &str = include_str!("../../tests/data/mlkem768-acvp.json");

fn vectors() -> Value {
    serde_json::from_str(VECTORS).unwrap()
}

fn hex(v: &Value) -> Vec<u8> {
    let s = v.as_str().unwrap();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn sha3_256(bytes: &[u8]) -> Vec<u8> {
    libcrux_sha3::sha256(bytes).to_vec()
}

#[test]
fn key_generation_matches_every_acvp_vector() {
    let v = vectors();
    let cases = v["keygen"].as_array().unwrap();
    assert_eq!(cases.len(), 25);
    for case in cases {
        let mut seed = [0u8; SEED_LEN];
        seed[..32].copy_from_slice(&hex(&case["d"]));
        seed[32..].copy_from_slice(&hex(&case["z"]));
        let pair = KemKeyPair::from_seed(seed);
        let id = &case["tcId"];
        assert_eq!(
            sha3_256(pair.encaps_key().as_bytes()),
            hex(&case["ek_sha3"]),
            "ek of case {id}"
        );
        assert_eq!(
            sha3_256(&expanded_decaps_key(&pair)),
            hex(&case["dk_sha3"]),
            "dk of case {id}"
        );
    }
}

#[test]
fn encapsulation_matches_the_acvp_vectors() {
    let v = vectors();
    for case in v["encapsulation"].as_array().unwrap() {
        let ek = EncapsKey::from_bytes(&hex(&case["ek"])).unwrap();
        let m: [u8; 32] = hex(&case["m"]).try_into().unwrap();
        let (ct, ss) = encapsulate_with(&ek, m);
        let id = &case["tcId"];
        assert_eq!(
            sha3_256(ct.as_bytes()),
            hex(&case["c_sha3"]),
            "c of case {id}"
        );
        assert_eq!(ss.as_bytes().to_vec(), hex(&case["k"]), "k of case {id}");
    }
}

#[test]
fn decapsulation_matches_the_acvp_vectors_including_implicit_rejection() {
    let v = vectors();
    let group = &v["decapsulation"];
    let dk = hex(&group["dk"]);
    let tests = group["tests"].as_array().unwrap();
    assert!(tests.iter().any(|t| t["reason"] == "modify ciphertext"));
    for case in tests {
        let ct = Ciphertext::from_bytes(&hex(&case["c"])).unwrap();
        let ss = decapsulate_expanded(&dk, &ct).unwrap();
        assert_eq!(
            ss.as_bytes().to_vec(),
            hex(&case["k"]),
            "k of case {} ({})",
            case["tcId"],
            case["reason"]
        );
    }
}
