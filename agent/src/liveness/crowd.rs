//! Many pairs of a kind in one read (a node whose peers went down together) are told as a
//! crowd: one line a kind, the first of them by name, each pair at debug.

use weft_backends::plan::liveness::Todo;

/// Up to this many pairs turning dead, backing off or repaired after one read are logged
/// one line each; more (a node whose peers went down together) get one line a kind, with
/// the first of them by name, and each pair at debug.
pub(super) const LOGGED: usize = 16;

#[derive(Default)]
pub(super) struct Crowd {
    pub(super) dead: Vec<String>,
    pub(super) backing_off: Vec<String>,
}

/// The crowds in one read's to-dos: each kind's nodes when more than `LOGGED`.
pub(super) fn crowd(todo: &[Todo]) -> Crowd {
    let nodes = |dead: bool| -> Vec<String> {
        let of_kind = |t: &&Todo| match t {
            Todo::Dead { .. } => dead,
            Todo::BackOff { .. } => !dead,
            _ => false,
        };
        if todo.iter().filter(of_kind).count() <= LOGGED {
            return Vec::new(); // each gets its own line: no names copied
        }
        todo.iter()
            .filter(of_kind)
            .filter_map(|t| match t {
                Todo::Dead { node, .. } | Todo::BackOff { node, .. } => Some(node.clone()),
                _ => None,
            })
            .collect()
    };
    Crowd {
        dead: nodes(true),
        backing_off: nodes(false),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use weft_backends::plan::liveness::Cause;

    use super::*;

    fn dead(n: usize) -> Todo {
        Todo::Dead {
            device: "flannel-wg".into(),
            node: format!("n{n}"),
            cause: Cause::DeviceNotAnswering,
            unanswered: Duration::from_secs(2),
        }
    }

    fn backing_off(n: usize) -> Todo {
        Todo::BackOff {
            device: "flannel-wg".into(),
            node: format!("n{n}"),
            pause: Duration::from_secs(10),
            cause: Cause::DeviceNotAnswering,
        }
    }

    /// Up to `LOGGED` pairs of a kind get a line each; past it, the kind is one crowd.
    #[test]
    fn many_pairs_of_a_kind_in_one_read_are_a_crowd() {
        let few: Vec<Todo> = (0..LOGGED)
            .map(dead)
            .chain((0..3).map(backing_off))
            .collect();
        let c = crowd(&few);
        assert!(c.dead.is_empty() && c.backing_off.is_empty());
        let many: Vec<Todo> = (0..=LOGGED)
            .map(dead)
            .chain((0..3).map(backing_off))
            .collect();
        let c = crowd(&many);
        assert_eq!(c.dead.len(), LOGGED + 1);
        assert_eq!(c.dead[0], "n0");
        assert!(c.backing_off.is_empty());
    }
}
