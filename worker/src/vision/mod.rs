//! Image input for vision-language models: the reference processors' preprocessing,
//! reproduced exactly (`resize`: Pillow's resampling).

pub mod resize;
