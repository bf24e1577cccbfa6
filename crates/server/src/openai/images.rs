//! Images in requests: `/infer`'s `image_b64` and chat `image_url` parts, read as `data:` URLs
//! or bare base64 (remote URLs only as [`image_url`] allows), held to `limits.maxImages`,
//! `maxImageBytes`, `maxImagePixels` and `maxRequestImagePixels`, counted against the worker's
//! in-flight budget (`maxInflightImagePixels`, 429 when spent), and decoded (PNG, JPEG, WebP)
//! off the async runtime, one decode per core at a time. Every refusal is a 4xx with a stable
//! code.

use std::io::Cursor;
use std::sync::Arc;

use axum::http::StatusCode;
use base64::Engine as _;
use image::{ImageFormat, ImageReader};
use mole_api::WorkerLimits;
use sha2::{Digest, Sha256};
use tokio::sync::OwnedSemaphorePermit;

use super::image_url;
use crate::error::bad;
use crate::state::PIXEL_UNIT;
use crate::{ApiError, AppState};
use mole_engine::api::Image;

/// An image as a request names it, before it is read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ImageSource {
    /// Bytes of the file (from base64 or a `data:` URL).
    Bytes(Vec<u8>),
    /// An `http(s)://` URL on an allowed host and port.
    Url(url::Url),
}

/// A 413 with a stable code.
fn too_large(code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, code, msg)
}

/// Base64, padded or not, standard or URL-safe alphabet, whitespace ignored (clients wrap
/// long lines).
fn decode_base64(data: &str) -> Result<Vec<u8>, base64::DecodeError> {
    use base64::engine::{general_purpose, DecodePaddingMode, GeneralPurpose};
    let cfg = general_purpose::GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::Indifferent);
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    GeneralPurpose::new(&base64::alphabet::STANDARD, cfg)
        .decode(&compact)
        .or_else(|_| GeneralPurpose::new(&base64::alphabet::URL_SAFE, cfg).decode(&compact))
}

/// An image field's value: a `data:` URL, an `http(s)://` URL (allowed hosts only), or bare
/// base64 (`/infer`'s `image_b64` as the seeds send it).
pub(crate) fn source(
    value: &str,
    field: &str,
    limits: &WorkerLimits,
) -> Result<ImageSource, ApiError> {
    let v = value.trim();
    let scheme = v.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
    if matches!(scheme.as_deref(), Some("http" | "https")) {
        return Ok(ImageSource::Url(image_url::parse_allowed(
            v, field, limits,
        )?));
    }
    let data = match v.strip_prefix("data:") {
        Some(rest) => {
            let (meta, data) = rest.split_once(',').ok_or_else(|| {
                bad(
                    "invalid_image",
                    format!("{field}: a data: URL needs a comma"),
                )
            })?;
            if !meta.ends_with(";base64") {
                return Err(bad(
                    "invalid_image",
                    format!("{field}: only base64 data: URLs are accepted"),
                ));
            }
            data
        }
        None => v,
    };
    // Refuse before decoding what cannot fit: base64 is 4 characters per 3 bytes.
    if data.len() as u64 / 4 * 3 > limits.max_image_bytes + 3 {
        return Err(too_large(
            "image_too_large",
            format!(
                "{field}: the image exceeds limits.maxImageBytes ({} bytes)",
                limits.max_image_bytes
            ),
        ));
    }
    let bytes = decode_base64(data)
        .map_err(|e| bad("invalid_image", format!("{field} is not valid base64: {e}")))?;
    check_bytes(&bytes, field, limits)?;
    Ok(ImageSource::Bytes(bytes))
}

fn check_bytes(bytes: &[u8], field: &str, limits: &WorkerLimits) -> Result<(), ApiError> {
    if bytes.len() as u64 > limits.max_image_bytes {
        return Err(too_large(
            "image_too_large",
            format!(
                "{field}: {} bytes exceed limits.maxImageBytes ({})",
                bytes.len(),
                limits.max_image_bytes
            ),
        ));
    }
    Ok(())
}

/// Refuses more images than `limits.maxImages`.
pub(crate) fn check_count(n: usize, limits: &WorkerLimits) -> Result<(), ApiError> {
    if n > limits.max_images as usize {
        return Err(bad(
            "too_many_images",
            format!("{n} images exceed limits.maxImages ({})", limits.max_images),
        ));
    }
    Ok(())
}

/// The share of `limits.maxInflightImagePixels` a request's images hold (in units of
/// [`PIXEL_UNIT`] pixels), given back when it is dropped: with the answer, or with the stream
/// when the answer is streamed.
pub(crate) struct HeldPixels(Option<OwnedSemaphorePermit>);

impl HeldPixels {
    /// Whether any pixels are held (the request had images).
    pub(crate) fn holds(&self) -> bool {
        self.0.is_some()
    }
}

/// Fetches URL images, holds the request's pixels against the in-flight budget (429
/// `images_busy` when it is spent: refused at once, not queued), then decodes them on the
/// preparation stage's threads (by `deadline`).
pub(crate) async fn read_all(
    s: &Arc<AppState>,
    sources: Vec<ImageSource>,
    deadline: std::time::Instant,
) -> Result<(Vec<Image>, HeldPixels), ApiError> {
    if sources.is_empty() {
        return Ok((Vec::new(), HeldPixels(None)));
    }
    let limits = s.cfg().limits.clone();
    let mut files = Vec::with_capacity(sources.len());
    for (i, src) in sources.into_iter().enumerate() {
        files.push(match src {
            ImageSource::Bytes(b) => b,
            ImageSource::Url(u) => {
                image_url::fetch(&u, &format!("image {}", i + 1), &limits).await?
            }
        });
    }
    // Every size from its header, before any pixel is decoded.
    let mut total = 0u64;
    for (i, f) in files.iter().enumerate() {
        let (_, w, h) = header(f, &format!("image {}", i + 1), &limits)?;
        total += u64::from(w) * u64::from(h);
    }
    if total > limits.max_request_image_pixels {
        return Err(too_large(
            "image_pixels_exceeded",
            format!(
                "the request's images have {total} pixels together, over \
                 limits.maxRequestImagePixels ({})",
                limits.max_request_image_pixels
            ),
        ));
    }
    let units = u32::try_from(total.div_ceil(PIXEL_UNIT)).unwrap_or(u32::MAX);
    let held = s
        .image_budget
        .clone()
        .try_acquire_many_owned(units)
        .map_err(|_| {
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "images_busy",
                "the images of the requests in flight fill limits.maxInflightImagePixels; \
                 retry shortly",
            )
            .with_retry_after(1)
        })?;
    let mut images = Vec::with_capacity(files.len());
    for (i, f) in files.into_iter().enumerate() {
        let limits = limits.clone();
        images.push(
            s.prepare
                .run(deadline, move || {
                    decode(&f, &format!("image {}", i + 1), &limits)
                })
                .await?,
        );
    }
    Ok((images, HeldPixels(Some(held))))
}

/// An image file's format (PNG, JPEG or WebP) and size from its header, the size held to
/// `maxImagePixels`.
fn header(
    bytes: &[u8],
    field: &str,
    limits: &WorkerLimits,
) -> Result<(ImageFormat, u32, u32), ApiError> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| bad("invalid_image", format!("{field}: {e}")))?;
    let format = match reader.format() {
        Some(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP)) => f,
        Some(f) => {
            return Err(bad(
                "unsupported_image_format",
                format!("{field}: {f:?} images are not accepted; send PNG, JPEG or WebP"),
            ))
        }
        None => {
            return Err(bad(
                "unsupported_image_format",
                format!("{field}: not a PNG, JPEG or WebP image"),
            ))
        }
    };
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| bad("invalid_image", format!("{field}: {e}")))?;
    let pixels = u64::from(w) * u64::from(h);
    if pixels > limits.max_image_pixels {
        return Err(too_large(
            "image_too_large",
            format!(
                "{field}: {w}×{h} is {pixels} pixels, over limits.maxImagePixels ({})",
                limits.max_image_pixels
            ),
        ));
    }
    Ok((format, w, h))
}

/// Decodes one image file into RGB: its format from its bytes (PNG, JPEG or WebP), its size
/// from its header and held to `maxImagePixels` before any pixel is decoded.
pub(crate) fn decode(bytes: &[u8], field: &str, limits: &WorkerLimits) -> Result<Image, ApiError> {
    let (format, w, h) = header(bytes, field, limits)?;
    let pixels = u64::from(w) * u64::from(h);
    let mut reader = ImageReader::new(Cursor::new(bytes));
    reader.set_format(format);
    let mut l = image::Limits::default();
    l.max_image_width = Some(w);
    l.max_image_height = Some(h);
    // The decoder's own buffers besides the RGBA bitmap at most.
    l.max_alloc = Some(pixels * 8 + (64 << 20));
    reader.limits(l);
    let img = reader
        .decode()
        .map_err(|e| bad("invalid_image", format!("{field}: {e}")))?;
    let rgb = img.into_rgb8();
    Ok(Image {
        width: w,
        height: h,
        rgb: Arc::from(rgb.into_raw()),
        digest: Sha256::digest(bytes).into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn b64(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    #[test]
    fn sources_read_base64_and_data_urls_and_refuse_remote_hosts_not_listed() {
        let mut limits = WorkerLimits::default();
        let p = png(3, 2);
        let want = ImageSource::Bytes(p.clone());
        assert_eq!(source(&b64(&p), "f", &limits).unwrap(), want);
        let url = format!("data:image/png;base64,{}", b64(&p));
        assert_eq!(source(&url, "f", &limits).unwrap(), want);
        let wrapped: String = b64(&p)
            .as_bytes()
            .chunks(10)
            .map(|c| format!("{}\n", std::str::from_utf8(c).unwrap()))
            .collect();
        assert_eq!(source(&wrapped, "f", &limits).unwrap(), want);
        let code = |r: Result<ImageSource, ApiError>| r.unwrap_err().code;
        assert_eq!(code(source("not base64!", "f", &limits)), "invalid_image");
        assert_eq!(
            code(source("data:image/png,raw", "f", &limits)),
            "invalid_image"
        );
        let remote = "https://img.example.com/a.png";
        assert_eq!(code(source(remote, "f", &limits)), "image_url_not_allowed");
        limits.image_url_hosts = vec!["img.example.com".into()];
        assert_eq!(
            source(remote, "f", &limits).unwrap(),
            ImageSource::Url(remote.parse().unwrap())
        );
        limits.max_image_bytes = 10;
        let e = source(&b64(&p), "f", &limits).unwrap_err();
        assert_eq!((e.status.as_u16(), e.code), (413, "image_too_large"));
    }

    #[test]
    fn decoding_checks_format_size_and_integrity() {
        let mut limits = WorkerLimits::default();
        let p = png(5, 4);
        let img = decode(&p, "f", &limits).unwrap();
        assert_eq!((img.width, img.height, img.rgb.len()), (5, 4, 60));
        assert_eq!(&img.rgb[..3], &[0, 0, 7]);
        assert_eq!(&img.rgb[3..6], &[1, 0, 7]);
        let code = |r: Result<Image, ApiError>| {
            let e = r.unwrap_err();
            (e.status.as_u16(), e.code)
        };
        assert_eq!(
            code(decode(&p[..p.len() / 2], "f", &limits)),
            (400, "invalid_image")
        );
        assert_eq!(
            code(decode(b"GIF89a\x01\x00\x01\x00", "f", &limits)),
            (400, "unsupported_image_format")
        );
        assert_eq!(
            code(decode(b"hello", "f", &limits)),
            (400, "unsupported_image_format")
        );
        limits.max_image_pixels = 19;
        assert_eq!(code(decode(&p, "f", &limits)), (413, "image_too_large"));
    }
}
