//! The model zoo's fixtures (`tests/fixtures/zoo/`, written by
//! `tests/fixtures/zoo_fixtures.py`): each model's file, `--inputs`, output and
//! 2048 held-out rows with onnxruntime's logit, for the zoo and
//! onnxruntime-backend tests.

use std::path::{Path, PathBuf};

use quiver::model::calibrate::read_npy;
use quiver::model::onnx::ImportOptions;
use quiver::model::{Model, OutputKind, Source};

pub struct Zoo {
    pub name: String,
    pub file: PathBuf,
    pub inputs: String,
    pub output: Option<String>,
    pub kind: OutputKind,
    pub dim: usize,
    pub x: Vec<f32>,
    pub labels: Vec<bool>,
    pub want: Vec<f32>,
}

impl Zoo {
    /// How the zoo tests import this model: version 1, its `--inputs` and
    /// output as the fixture index names them.
    pub fn import_options(&self) -> ImportOptions {
        ImportOptions {
            name: self.name.clone(),
            version: 1,
            inputs: self.inputs.parse().unwrap(),
            output: self.output.clone(),
            output_kind: self.kind,
            base_dir: None,
        }
    }
}

pub fn zoo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/zoo")
}

pub fn zoo() -> Vec<Zoo> {
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(zoo_dir().join("zoo.json")).unwrap()).unwrap();
    let mut out = Vec::new();
    for (name, m) in index["models"].as_object().unwrap() {
        let dim = m["dim"].as_u64().unwrap() as usize;
        let table = read_npy(&zoo_dir().join(m["data"].as_str().unwrap())).unwrap();
        assert_eq!(table.cols, dim + 2, "{name}");
        let (mut x, mut labels, mut want) = (Vec::new(), Vec::new(), Vec::new());
        for row in table.data.chunks_exact(table.cols) {
            x.extend_from_slice(&row[..dim]);
            labels.push(row[dim] > 0.5);
            want.push(row[dim + 1]);
        }
        out.push(Zoo {
            name: name.clone(),
            file: zoo_dir().join(m["file"].as_str().unwrap()),
            inputs: m["inputs"].as_str().unwrap().to_string(),
            output: m["output"].as_str().map(str::to_string),
            kind: if m["output_kind"] == "raw" { OutputKind::Raw } else { OutputKind::Logit },
            dim,
            x,
            labels,
            want,
        });
    }
    assert_eq!(out.len(), 19, "the zoo has 19 models");
    out
}

pub fn segment<'r>(model: &Model, row: &'r [f32], source: Source) -> &'r [f32] {
    let mut at = 0;
    for s in &model.inputs {
        if s.source == source {
            return &row[at..at + s.dim];
        }
        at += s.dim;
    }
    &[]
}
