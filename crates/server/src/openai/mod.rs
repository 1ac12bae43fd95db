//! The OpenAI wire format in vLLM's dialect: request and response types, the error shape, and
//! the one place where wire requests become validated engine requests (`params`). Python's
//! bindings parse through the same code, so both ways in accept and reject exactly the same input.

pub mod error;
pub mod media;
pub mod params;
pub mod parse;
pub mod structured;
pub mod tool_choice;
pub mod tools;
pub mod types;
