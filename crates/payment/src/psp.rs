//! PSP simulator.
