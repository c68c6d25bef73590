//! Benchmark output: an aligned table on stdout, CSV and an SVG bar chart.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

/// One measured figure.
pub struct Row {
    pub group: String,
    pub case: String,
    pub value: f64,
    pub unit: &'static str,
    /// Reference value measured in the same run, if any (e.g. native).
    pub reference: Option<f64>,
}

impl Row {
    pub fn ratio(&self) -> Option<f64> {
        self.reference.filter(|r| *r > 0.0).map(|r| self.value / r)
    }
}

pub fn print_table(rows: &[Row]) {
    println!("{:<26} {:<34} {:>16} {:<10} {:>16} {:>8}", "group", "case", "value", "unit", "reference", "ratio");
    for r in rows {
        let reference = r.reference.map_or(String::new(), |v| format!("{v:.3}"));
        let ratio = r.ratio().map_or(String::new(), |v| format!("{v:.3}"));
        println!("{:<26} {:<34} {:>16.3} {:<10} {:>16} {:>8}", r.group, r.case, r.value, r.unit, reference, ratio);
    }
}

pub fn write_csv(path: &Path, rows: &[Row]) -> std::io::Result<()> {
    let mut s = String::from("group,case,value,unit,reference,ratio\n");
    for r in rows {
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
        let _ = writeln!(s, "{},{},{},{},{},{}", r.group, r.case, r.value, r.unit, opt(r.reference), opt(r.ratio()));
    }
    std::fs::write(path, s)
}

/// Horizontal bars of `rows` that share `unit`, one chart.
pub fn write_bar_chart(path: &Path, title: &str, rows: &[&Row]) -> Result<(), Box<dyn std::error::Error>> {
    let height = 80 + 36 * rows.len() as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = rows.iter().map(|r| r.value).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let labels: Vec<String> = rows.iter().map(|r| format!("{} {}", r.group, r.case)).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(330)
        .build_cartesian_2d(0.0..max, 0..rows.len())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(rows.len())
        .y_label_formatter(&|i| labels.get(*i).cloned().unwrap_or_default())
        .draw()?;
    chart.draw_series(rows.iter().enumerate().map(|(i, r)| Rectangle::new([(0.0, i), (r.value, i + 1)], BLUE.mix(0.6).filled())))?;
    root.present()?;
    Ok(())
}
