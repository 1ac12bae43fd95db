//! Shared building blocks every architecture assembles: linear layers, norms, rotary embeddings,
//! paged attention, gated MLP and the decoder stack that ties them together. Features (bias,
//! per-head norms, sliding windows, tied embeddings) are options of these layers, never copies of
//! a model.

pub mod attention;
pub mod decoder;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod rotary;
pub mod vision;
