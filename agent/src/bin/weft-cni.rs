//! `weft-cni`: the CNI plugin (see `weft::cni`); installed as `/opt/cni/bin/flannel`.

fn main() {
    std::process::exit(weft::cni::main());
}
