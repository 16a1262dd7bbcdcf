//! `weft keys generate | public | psk`: the same text as `wg genkey | pubkey | genpsk`.

use std::io::{Read, Write};

use anyhow::Context;
use weft_crypto::{PresharedKey, PrivateKey};

use crate::cli::KeysCommand;

pub fn run(command: &KeysCommand, input: &mut dyn Read, out: &mut dyn Write) -> anyhow::Result<()> {
    let line = match command {
        KeysCommand::Generate => PrivateKey::generate()
            .context("generating a private key")?
            .to_base64_secret(),
        KeysCommand::Psk => PresharedKey::generate()
            .context("generating a pre-shared key")?
            .to_base64_secret(),
        KeysCommand::Rotate(_) => anyhow::bail!("`keys rotate` runs through commands::rotate"),
        KeysCommand::Public => {
            let mut text = String::new();
            input
                .read_to_string(&mut text)
                .context("reading a private key from standard input")?;
            let key: PrivateKey = text
                .parse()
                .context("standard input does not hold a WireGuard private key")?;
            zeroize::Zeroize::zeroize(&mut text);
            key.public_key().to_base64()
        }
    };
    writeln!(out, "{line}").context("writing to standard output")?;
    Ok(())
}
