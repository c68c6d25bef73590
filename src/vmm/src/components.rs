//! A VM's state as a tree of components by id: each vCPU, each device, the
//! clock, guest memory, saved by its own `Persist` and encoded on its own.
//!
//! Snapshots and checkpoints carry this map rather than a struct with a
//! field per kind of component, so whatever compares, sends or stores the
//! state (a checkpoint's delta, a replica's `syncvm`) works by id and bytes
//! and needs no change when the VM gains a component: only the VM that
//! saves and restores it knows what each id holds.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::persist::{self, Persist};

/// A component's name in the tree, stable across processes and versions of
/// the same VM shape: `memory`, `clock`, `vcpu/0`, `devices/net0`, ...
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ComponentId(String);

impl ComponentId {
    pub fn new(id: impl Into<String>) -> ComponentId {
        ComponentId(id.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ComponentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ComponentError {
    #[error("the saved state has no {0}")]
    Missing(ComponentId),
    #[error("the saved state's {id} does not decode: {err}")]
    Malformed { id: ComponentId, err: postcard::Error },
    #[error("the saved state has a {0}, which this VM does not")]
    Unexpected(ComponentId),
}

/// Every component's state, encoded, by id.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Components(BTreeMap<ComponentId, Vec<u8>>);

impl Components {
    /// Save `part` as component `id`.
    pub fn save<P: Persist>(&mut self, id: ComponentId, part: &P) -> Result<(), P::Error> {
        let state = part.save()?;
        self.put(id, &state);
        Ok(())
    }

    /// Store `state` as component `id`: for a part of a component's state
    /// kept apart (see `vm`'s vCPU time-stamp counter).
    pub fn put<T: Serialize>(&mut self, id: ComponentId, state: &T) {
        self.0.insert(id, persist::encode(state));
    }

    /// Component `id`'s state, decoded.
    pub fn state<T: DeserializeOwned>(&self, id: &ComponentId) -> Result<T, ComponentError> {
        let bytes = self.get(id).ok_or_else(|| ComponentError::Missing(id.clone()))?;
        persist::decode(bytes).map_err(|err| ComponentError::Malformed { id: id.clone(), err })
    }

    /// Decode component `id` and load it into `part`.
    pub fn restore<P: Persist>(&self, id: &ComponentId, part: &mut P) -> Result<(), P::Error>
    where
        P::Error: From<ComponentError>,
    {
        part.restore(&self.state(id)?)
    }

    pub fn insert(&mut self, id: ComponentId, bytes: Vec<u8>) {
        self.0.insert(id, bytes);
    }

    pub fn get(&self, id: &ComponentId) -> Option<&[u8]> {
        self.0.get(id).map(Vec::as_slice)
    }

    pub fn contains(&self, id: &ComponentId) -> bool {
        self.0.contains_key(id)
    }

    pub fn remove(&mut self, id: &ComponentId) -> Option<Vec<u8>> {
        self.0.remove(id)
    }

    pub fn ids(&self) -> impl Iterator<Item = &ComponentId> {
        self.0.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ComponentId, &[u8])> {
        self.0.iter().map(|(id, bytes)| (id, bytes.as_slice()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the ids are exactly `expected`: otherwise the first one
    /// missing, or else the first one this VM has no place for.
    pub fn check_ids(&self, expected: &[ComponentId]) -> Result<(), ComponentError> {
        if let Some(missing) = expected.iter().find(|id| !self.contains(id)) {
            return Err(ComponentError::Missing(missing.clone()));
        }
        match self.ids().find(|id| !expected.contains(id)) {
            Some(extra) => Err(ComponentError::Unexpected(extra.clone())),
            None => Ok(()),
        }
    }
}

impl FromIterator<(ComponentId, Vec<u8>)> for Components {
    fn from_iter<I: IntoIterator<Item = (ComponentId, Vec<u8>)>>(iter: I) -> Components {
        Components(iter.into_iter().collect())
    }
}

impl IntoIterator for Components {
    type Item = (ComponentId, Vec<u8>);
    type IntoIter = std::collections::btree_map::IntoIter<ComponentId, Vec<u8>>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl Extend<(ComponentId, Vec<u8>)> for Components {
    fn extend<I: IntoIterator<Item = (ComponentId, Vec<u8>)>>(&mut self, iter: I) {
        self.0.extend(iter);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A component whose state is a number.
    struct Counter(u64);

    #[derive(Debug, PartialEq)]
    struct CounterError(String);

    impl From<ComponentError> for CounterError {
        fn from(e: ComponentError) -> CounterError {
            CounterError(e.to_string())
        }
    }

    impl Persist for Counter {
        type State = u64;
        type Error = CounterError;

        fn save(&self) -> Result<u64, CounterError> {
            Ok(self.0)
        }

        fn restore(&mut self, state: &u64) -> Result<(), CounterError> {
            self.0 = *state;
            Ok(())
        }
    }

    #[test]
    fn a_component_round_trips_through_its_id_and_the_encoding() {
        let mut c = Components::default();
        c.save(ComponentId::new("counter"), &Counter(7)).unwrap();
        let c: Components = persist::decode(&persist::encode(&c)).unwrap();
        let mut restored = Counter(0);
        c.restore(&ComponentId::new("counter"), &mut restored).unwrap();
        assert_eq!(restored.0, 7);
        let err = c.restore(&ComponentId::new("other"), &mut restored).unwrap_err();
        assert_eq!(err, CounterError("the saved state has no other".into()));
    }

    #[test]
    fn ids_must_be_exactly_the_expected_ones() {
        let ids = |names: &[&str]| names.iter().map(|n| ComponentId::new(*n)).collect::<Vec<_>>();
        let c: Components = ids(&["a", "b"]).into_iter().map(|id| (id, vec![0])).collect();
        c.check_ids(&ids(&["a", "b"])).unwrap();
        assert_eq!(c.check_ids(&ids(&["a", "b", "c"])).unwrap_err().to_string(), "the saved state has no c");
        assert_eq!(c.check_ids(&ids(&["a"])).unwrap_err().to_string(), "the saved state has a b, which this VM does not");
    }
}
