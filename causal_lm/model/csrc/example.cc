// The smallest kernel: y = a * x + b elementwise, float32. It exists so that the build and registration path of
// native.py is tested on its own (tests/test_native.py), apart from any real kernel.
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error AffineImpl(float a, float b, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t n = x.element_count();
  const float* in = x.typed_data();
  float* out = y->typed_data();
  for (int64_t i = 0; i < n; ++i) out[i] = a * in[i] + b;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(causal_lm_affine, AffineImpl,
                              ffi::Ffi::Bind().Attr<float>("a").Attr<float>("b").Arg<ffi::Buffer<ffi::F32>>().Ret<
                                  ffi::Buffer<ffi::F32>>());
