#include <gtest/gtest.h>

#include "flotilla/data/dataset.h"
#include "flotilla/data/image.h"

namespace flotilla::data {
namespace {

torch::Tensor images(std::int64_t n) {
  return torch::randint(0, 256, {n, 1, 6, 6}, torch::kUInt8);
}

TEST(Image, FlipIsStatelessSeededAndFlipsAboutHalf) {
  const auto x = images(400);
  const auto a = image::random_flip_left_right(x, 17);
  EXPECT_TRUE(torch::equal(a, image::random_flip_left_right(x, 17))); // same seed, same result
  EXPECT_FALSE(torch::equal(a, image::random_flip_left_right(x, 18)));
  std::int64_t flipped = 0;
  for (std::int64_t i = 0; i < 400; ++i) {
    const bool same = torch::equal(a[i], x[i]);
    const bool mirrored = torch::equal(a[i], x[i].flip({-1}));
    EXPECT_TRUE(same || mirrored) << i;
    flipped += mirrored && !same;
  }
  EXPECT_GT(flipped, 150);
  EXPECT_LT(flipped, 250);
}

TEST(Image, CropWithPaddingShiftsEachImageWithinThePadding) {
  const auto x = images(50);
  const auto y = image::random_crop_with_padding(x, 2, 5);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_TRUE(torch::equal(y, image::random_crop_with_padding(x, 2, 5)));
  EXPECT_TRUE(torch::equal(image::random_crop_with_padding(x, 0, 5), x));
  const auto padded = torch::constant_pad_nd(x, {2, 2, 2, 2}, 0);
  std::int64_t moved = 0;
  for (std::int64_t i = 0; i < 50; ++i) {
    bool found = false; // y[i] is one of the 25 windows of the padded image
    for (int dy = 0; dy <= 4 && !found; ++dy) {
      for (int dx = 0; dx <= 4 && !found; ++dx) {
        found = torch::equal(y[i], padded[i].narrow(-2, dy, 6).narrow(-1, dx, 6));
        if (found && (dy != 2 || dx != 2)) ++moved;
      }
    }
    EXPECT_TRUE(found) << i;
  }
  EXPECT_GT(moved, 30); // 24 of 25 offsets move the image
}

TEST(Image, NormalizeMapsPixelsToStandardScores) {
  const auto x = torch::tensor({0, 255}, torch::kUInt8);
  const auto y = image::normalize(x, 0.5, 0.25);
  EXPECT_NEAR(y[0].item<float>(), -2.0, 1e-6);
  EXPECT_NEAR(y[1].item<float>(), 2.0, 1e-6);
}

TEST(Image, RandomSeedsAreReproduciblePerPassAndSkippable) {
  auto ds = Dataset::random(9).take(20);
  std::vector<std::int64_t> first, second, again;
  for (const Element& e : ds.make_iterator()) first.push_back(e[0].item<std::int64_t>());
  for (const Element& e : ds.make_iterator()) second.push_back(e[0].item<std::int64_t>());
  for (const Element& e : Dataset::random(9).take(20).make_iterator()) {
    again.push_back(e[0].item<std::int64_t>());
  }
  EXPECT_EQ(first, again);
  EXPECT_NE(first, second); // a new pass, new seeds
  auto it = ds.make_iterator();
  for (int i = 0; i < 5; ++i) it.next();
  auto resumed = ds.make_iterator(it.save());
  EXPECT_EQ(resumed.next()->at(0).item<std::int64_t>(), it.next()->at(0).item<std::int64_t>());
}

} // namespace
} // namespace flotilla::data
