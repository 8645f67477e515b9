//! [`PaymentCodec`]: prost encoding, with a decode failure answered by who is at fault.
//!
//! tonic's prost codec turns every message that does not decode into `INTERNAL`. For the
//! server that is wrong: undecodable request bytes are the caller's mistake, and `INTERNAL`
//! (a 5xx to the idempotency layer) would mark the key failed under the fingerprint of those
//! bytes, so the same key with a valid message would be refused as reused. A request message
//! that does not decode is `INVALID_ARGUMENT` (the key stays unused); a response that does not
//! decode (on the client) stays `INTERNAL`, as the gRPC status code guide says.

use std::marker::PhantomData;

use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstEncoder};

use super::proto::{ChargeRequest, ChargeResponse, GetChargeRequest};

/// Who receives a message type, and so what its decode failure is.
pub trait Received: prost::Message + Default + Send + 'static {
    /// The status of a message of this type that does not decode.
    fn undecodable(error: prost::DecodeError) -> Status;
}

/// A request message: what the server receives from callers.
macro_rules! request_message {
    ($($t:ty),*) => {$(
        impl Received for $t {
            fn undecodable(error: prost::DecodeError) -> Status {
                Status::invalid_argument(format!(
                    "the request message does not decode as {}: {error}",
                    stringify!($t)
                ))
            }
        }
    )*};
}
request_message!(ChargeRequest, GetChargeRequest);

impl Received for ChargeResponse {
    fn undecodable(error: prost::DecodeError) -> Status {
        Status::internal(format!("the response message does not decode: {error}"))
    }
}

/// The codec of `payment.v1.Payment` (server and client): prost, with decode failures by
/// [`Received`].
#[derive(Debug, Clone)]
pub struct PaymentCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for PaymentCodec<T, U> {
    fn default() -> Self {
        PaymentCodec {
            _types: PhantomData,
        }
    }
}

impl<T, U> Codec for PaymentCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: Received,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = PaymentDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        PaymentDecoder { _type: PhantomData }
    }
}

/// The decoder of [`PaymentCodec`].
#[derive(Debug, Clone, Default)]
pub struct PaymentDecoder<U> {
    _type: PhantomData<U>,
}

impl<U: Received> Decoder for PaymentDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(U::undecodable)
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn undecodable_requests_are_the_callers_mistake_responses_are_internal() {
        // Field 1 as a varint where a string is expected, then a truncated length.
        let junk = [0x08, 0x96, 0x01, 0x12];
        let err = <ChargeRequest as prost::Message>::decode(&junk[..]).unwrap_err();
        assert_eq!(
            ChargeRequest::undecodable(err.clone()).code(),
            Code::InvalidArgument
        );
        assert_eq!(
            GetChargeRequest::undecodable(err.clone()).code(),
            Code::InvalidArgument
        );
        assert_eq!(ChargeResponse::undecodable(err).code(), Code::Internal);
    }
}
