#include "rig/core/tensor.h"

#include <cstring>

#include "rig/core/allocator.h"

namespace rig {

std::string Device::str() const {
  if (is_cpu()) return "cpu";
  return fmt::format("cuda:{}", index);
}

Device Device::parse(std::string_view s) {
  if (s == "cpu") return cpu();
  if (s == "cuda" || s == "gpu") return cuda(0);
  if (s.substr(0, 5) == "cuda:") {
    std::string idx(s.substr(5));
    if (!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos)
      return cuda(std::stoi(idx));
  }
  bad_input("device '{}' is not one of cpu, cuda, cuda:N", s);
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

namespace {
struct OwnedBlock {
  OwnedBlock(Allocator* a, void* q, size_t n) : alloc(a), p(q), bytes(n) {}
  OwnedBlock(const OwnedBlock&) = delete;
  OwnedBlock& operator=(const OwnedBlock&) = delete;
  Allocator* alloc;
  void* p;
  size_t bytes;
  ~OwnedBlock() { alloc->deallocate(p, bytes); }
};
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device dev, std::string_view what) {
  for (auto d : shape) RIG_CHECK(d >= 0, "negative dimension in shape {} of {}", shape_str(shape), what);
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = dev;
  Allocator& a = allocator_for(dev);
  size_t bytes = dtype_nbytes(dtype, shape_numel(shape));
  void* p = a.allocate(bytes, fmt::format("{} {} {}", what, dtype_name(dtype), shape_str(shape)));
  t.storage_ = std::make_shared<OwnedBlock>(&a, p, bytes);
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device dev, std::string_view what) {
  Tensor t = empty(shape, dtype, dev, what);
  t.zero_();
  return t;
}

Tensor Tensor::view(void* data, const Shape& shape, DType dtype, Device dev,
                    std::shared_ptr<void> owner) {
  Tensor t;
  t.storage_ = owner ? std::move(owner) : std::shared_ptr<void>(data, [](void*) {});
  t.data_ = data;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = dev;
  return t;
}

Tensor Tensor::from_f32(const std::vector<float>& v, const Shape& shape) {
  RIG_CHECK(int64_t(v.size()) == shape_numel(shape), "{} values for shape {}", v.size(),
            shape_str(shape));
  Tensor t = empty(shape, DType::F32);
  std::memcpy(t.data_, v.data(), v.size() * 4);
  return t;
}

float* Tensor::f32() const {
  RIG_CHECK(dtype_ == DType::F32, "expected an F32 tensor, got {}", dtype_name(dtype_));
  return static_cast<float*>(data_);
}

Tensor Tensor::reshape(const Shape& shape) const {
  RIG_CHECK(shape_numel(shape) == numel(), "cannot reshape {} to {}", shape_str(shape_),
            shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  RIG_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0],
            "rows [{}, {}) out of range for {}", begin, end, shape_str(shape_));
  RIG_CHECK(dtype_ != DType::NF4, "slice_rows of a packed tensor");
  Tensor t = *this;
  int64_t row = numel() / (shape_[0] ? shape_[0] : 1);
  t.shape_[0] = end - begin;
  t.data_ = static_cast<char*>(data_) + size_t(begin * row) * dtype_size(dtype_);
  return t;
}

Tensor Tensor::clone(std::string_view what) const { return to(device_, what); }

Tensor Tensor::to(Device dev, std::string_view what) const {
  Tensor t = empty(shape_, dtype_, dev, what);
  copy_bytes(t.data_, dev, data_, device_, nbytes());
  return t;
}

Tensor Tensor::to_dtype(DType dt) const {
  if (dt == dtype_) return *this;
  RIG_CHECK(device_.is_cpu(), "to_dtype on {} is not supported", device_.str());
  Tensor t = empty(shape_, dt, device_, "converted tensor");
  if (dt == DType::F32) {
    convert_to_f32(dtype_, data_, t.data<float>(), size_t(numel()));
  } else {
    RIG_CHECK(dtype_ == DType::F32, "cannot convert {} to {}", dtype_name(dtype_), dtype_name(dt));
    convert_from_f32(dt, data<float>(), t.data_, size_t(numel()));
  }
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  RIG_CHECK(src.shape_ == shape_ && src.dtype_ == dtype_, "copy_from: {} {} into {} {}",
            dtype_name(src.dtype_), shape_str(src.shape_), dtype_name(dtype_), shape_str(shape_));
  copy_bytes(data_, device_, src.data_, src.device_, nbytes());
}

}  // namespace rig
