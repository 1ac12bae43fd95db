//! LoRA adapters. Today: PEFT adapter directories read and checked against the base model
//! ([`peft`]). The registry (name -> `AdapterId`, load/unload), the device slots and the LoRA
//! linear method that applies each row's adapter come with multi-adapter serving.

pub mod peft;

pub use peft::{AdapterConfig, BaseShape, LoraAdapter, LoraError, LoraModule, Target};
