// Typed views of XLA FFI buffers shared by the native kernels.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace ba_native {

// A buffer's data as T (float for f32, uint16_t bits for bf16).
template <typename T>
const T* In(const xla::ffi::AnyBuffer& b) {
  return static_cast<const T*>(b.untyped_data());
}

template <typename T>
T* Out(xla::ffi::Result<xla::ffi::AnyBuffer>& b) {
  return static_cast<T*>(b->untyped_data());
}

}  // namespace ba_native
