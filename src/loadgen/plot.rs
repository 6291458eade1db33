//! PNG plots of benchmark results (the `plotters` crate, bitmap backend).
//!
//! Text is drawn with a TrueType font read from the system at run time
//! (DejaVu Sans, Debian package `fonts-dejavu-core`), so no font is embedded
//! in the binary.

use std::path::Path;

use plotters::prelude::*;

/// Where DejaVu Sans is found on Debian-like systems.
const FONT_PATHS: [&str; 2] =
    ["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/dejavu/DejaVuSans.ttf"];
const SIZE: (u32, u32) = (1100, 700);
const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn register_font() -> Result<(), String> {
    static DONE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let path = FONT_PATHS.iter().find(|p| Path::new(p).exists()).ok_or_else(|| {
            format!("no DejaVu Sans font at {FONT_PATHS:?}; install it (apt-get install fonts-dejavu-core)")
        })?;
        let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
        plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
            .map_err(|_| format!("{path}: not a usable font"))
    })
    .clone()
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The series' names, upper left, in every plot's one style.
fn legend<'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)
}

/// Latency by percentile on a log "nines" axis: x = -log10(1 - p/100).
pub fn percentiles(out: &Path, title: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<(), String> {
    register_font()?;
    let nines = |p: f64| -(1.0 - (p / 100.0).min(0.99999)).log10();
    let x_max = 5.0f64;
    let y_max = series.iter().flat_map(|(_, pts)| pts.iter().map(|p| p.1)).fold(1.0f64, f64::max) * 1.1;
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max, (1.0f64..y_max).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (µs)")
        .x_labels(6)
        .x_label_formatter(&|x| match x.round() as i32 {
            0 => "0".into(),
            1 => "90".into(),
            2 => "99".into(),
            3 => "99.9".into(),
            4 => "99.99".into(),
            5 => "99.999".into(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|&(p, v)| (nines(p).min(x_max), v.max(1.0))),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    legend(&mut chart)?;
    root.present().map_err(err)
}

/// p99 against offered rate, one line per sweep.
pub fn sweep(out: &Path, title: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<(), String> {
    register_font()?;
    let all = || series.iter().flat_map(|(_, pts)| pts.iter());
    let x_max = all().map(|p| p.0).fold(1.0f64, f64::max) * 1.05;
    let y_max = all().map(|p| p.1).fold(1.0f64, f64::max) * 1.2;
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max, (1.0f64..y_max).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("offered rate (requests/s)")
        .y_desc("p99 latency (µs)")
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().map(|&(x, y)| (x, y.max(1.0))), color.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&(x, y)| Circle::new((x, y.max(1.0)), 4, color.filled()))).map_err(err)?;
    }
    legend(&mut chart)?;
    root.present().map_err(err)
}

/// A measure against entity count on log-log axes, one line per series
/// (`bench/scale.rs`'s curves): how a cost grows with the work.
pub fn scale(out: &Path, title: &str, y_desc: &str, series: &[(String, Vec<(f64, f64)>)]) -> Result<(), String> {
    register_font()?;
    let all = || series.iter().flat_map(|(_, pts)| pts.iter());
    let x_min = all().map(|p| p.0).fold(f64::INFINITY, f64::min).max(1.0) / 1.5;
    let x_max = all().map(|p| p.0).fold(1.0f64, f64::max) * 1.5;
    let y_min = all().map(|p| p.1).filter(|y| *y > 0.0).fold(f64::INFINITY, f64::min).min(1.0) / 2.0;
    let y_max = all().map(|p| p.1).fold(1.0f64, f64::max) * 2.0;
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d((x_min..x_max).log_scale(), (y_min..y_max).log_scale())
        .map_err(err)?;
    chart.configure_mesh().x_desc("entities").y_desc(y_desc).label_style(("sans-serif", 16)).draw().map_err(err)?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (x, y.max(y_min))).collect();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(err)?;
    }
    legend(&mut chart)?;
    root.present().map_err(err)
}
