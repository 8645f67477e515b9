//! [`Logical`]: what one logical request asks for, whichever policy drives it.

/// One logical request's business data.
#[derive(Debug)]
pub(crate) struct Logical {
    pub(crate) order_id: String,
    pub(crate) amount_cents: u64,
}
