//! Benchmark output: an aligned table on stdout, CSV and an SVG bar chart.

use std::fmt::Write as _;
use std::path::Path;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

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
    let width = |f: fn(&Row) -> usize, title: &str| rows.iter().map(f).max().unwrap_or(0).max(title.len());
    let (g, c) = (width(|r| r.group.len(), "group"), width(|r| r.case.len(), "case"));
    println!("{:<g$} {:<c$} {:>16} {:<10} {:>16} {:>8}", "group", "case", "value", "unit", "reference", "ratio");
    for r in rows {
        let reference = r.reference.map_or(String::new(), |v| format!("{v:.3}"));
        let ratio = r.ratio().map_or(String::new(), |v| format!("{v:.3}"));
        println!("{:<g$} {:<c$} {:>16.3} {:<10} {:>16} {:>8}", r.group, r.case, r.value, r.unit, reference, ratio);
    }
}

/// A CSV field: quoted (RFC 4180) when it holds a comma or a quote, as
/// case names do ("4096 pages seq, 1 vCPU, epoch 20 ms: writes/s").
fn field(text: &str) -> String {
    if text.contains([',', '"', '\n']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

pub fn write_csv(path: &Path, rows: &[Row]) -> std::io::Result<()> {
    let mut s = String::from("group,case,value,unit,reference,ratio\n");
    for r in rows {
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v}"));
        let _ = writeln!(s, "{},{},{},{},{},{}", field(&r.group), field(&r.case), r.value, r.unit, opt(r.reference), opt(r.ratio()));
    }
    std::fs::write(path, s)
}

/// A table whose columns are not [`Row`]'s: text cells under named
/// columns, printed aligned (numbers to the right) and written as CSV.
pub struct Table {
    pub columns: Vec<&'static str>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn print(&self) {
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| self.rows.iter().filter_map(|r| r.get(i)).map(|c| c.chars().count()).chain([self.columns[i].len()]).max().unwrap_or(0))
            .collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, &w)| if c.parse::<f64>().is_ok() { format!("{c:>w$}") } else { format!("{c:<w$}") })
                .collect();
            println!("{}", padded.join("  ").trim_end());
        };
        line(&self.columns.iter().map(|c| c.to_string()).collect::<Vec<_>>());
        for r in &self.rows {
            line(r);
        }
    }

    pub fn write_csv(&self, path: &Path) -> std::io::Result<()> {
        let mut s = self.columns.join(",") + "\n";
        for r in &self.rows {
            let _ = writeln!(s, "{}", r.iter().map(|c| field(c)).collect::<Vec<_>>().join(","));
        }
        std::fs::write(path, s)
    }
}

/// `publish` for a [`Table`].
pub fn publish_table(out: &Path, name: &str, table: &Table, chart: &BarChart) -> Result<(), Box<dyn std::error::Error>> {
    table.print();
    let (csv, svg) = (out.join(format!("{name}.csv")), out.join(format!("{name}.svg")));
    table.write_csv(&csv)?;
    write_bar_chart(&svg, chart)?;
    println!("\nwrote {} and {}", csv.display(), svg.display());
    Ok(())
}

/// What every benchmark ends with: the table on stdout, `out/NAME.csv` and
/// `out/NAME.svg` with `chart`, and where they went.
pub fn publish(out: &Path, name: &str, rows: &[Row], chart: &BarChart) -> Result<(), Box<dyn std::error::Error>> {
    print_table(rows);
    let (csv, svg) = (out.join(format!("{name}.csv")), out.join(format!("{name}.svg")));
    write_csv(&csv, rows)?;
    write_bar_chart(&svg, chart)?;
    println!("\nwrote {} and {}", csv.display(), svg.display());
    Ok(())
}

/// A bar chart of one quantity: one vertical bar per category.
pub struct BarChart<'a> {
    pub title: &'a str,
    /// What the categories are (the x axis title).
    pub category: &'a str,
    /// What the bars measure, with the unit (the y axis title).
    pub quantity: &'a str,
    /// (category label, value), left to right.
    pub bars: Vec<(String, f64)>,
    /// A value to mark with a horizontal line (1 for ratios).
    pub reference: Option<f64>,
}

const LABEL_FONT: u32 = 13;
/// Generous width of one label character at LABEL_FONT (no font metrics
/// without a font backend).
const LABEL_CHAR_PX: u32 = 6;

/// Write `chart` as SVG. Each bar is centred on its own label, which hangs
/// below the axis (rotated, read bottom to top).
pub fn write_bar_chart(path: &Path, chart: &BarChart) -> Result<(), Box<dyn std::error::Error>> {
    if chart.bars.is_empty() {
        return Err(format!("no bars for {}", path.display()).into());
    }
    let n = chart.bars.len();
    let longest = chart.bars.iter().map(|(l, _)| l.chars().count()).max().unwrap_or(0) as u32;
    let label_area = LABEL_CHAR_PX * longest + 50;
    // Room for every bar, and for the title (20 px type, about 11 px a character).
    let width = (140 + 40 * n as u32).max(520).max(11 * chart.title.chars().count() as u32 + 40);
    let root = SVGBackend::new(path, (width, 380 + label_area)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = chart.bars.iter().map(|(_, v)| *v).chain(chart.reference).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    // Segments 0..=n-1: bar i fills segment i, its label sits at the centre.
    let mut c = ChartBuilder::on(&root)
        .caption(chart.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(label_area)
        .y_label_area_size(80)
        .build_cartesian_2d((0..n - 1).into_segmented(), 0.0..top)?;
    c.configure_mesh()
        .disable_x_mesh()
        // Ticks at the segment centres; the labels are drawn below, rotated.
        .x_labels(n)
        .x_label_formatter(&|_| String::new())
        .x_desc(chart.category)
        .y_desc(chart.quantity)
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    // Bar i spans segment i, from its left end to the next one's.
    let gap = ((width - 140) / n as u32 / 8).max(2);
    c.draw_series(chart.bars.iter().enumerate().map(|(i, (_, v))| {
        let right = if i + 1 < n { SegmentValue::Exact(i + 1) } else { SegmentValue::Last };
        let mut bar = Rectangle::new([(SegmentValue::Exact(i), 0.0), (right, *v)], BLUE.mix(0.6).filled());
        bar.set_margin(0, 0, gap, gap);
        bar
    }))?;
    if let Some(r) = chart.reference {
        c.draw_series(LineSeries::new([(SegmentValue::Exact(0), r), (SegmentValue::Last, r)], BLACK.stroke_width(1)))?;
    }
    let style = TextStyle::from(("sans-serif", LABEL_FONT).into_font())
        .transform(FontTransform::Rotate270)
        .pos(Pos::new(HPos::Right, VPos::Center));
    for (i, (label, _)) in chart.bars.iter().enumerate() {
        let (x, y) = c.backend_coord(&(SegmentValue::CenterOf(i), 0.0));
        root.draw(&Text::new(label.as_str(), (x, y + 10), style.clone()))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of attribute `name` in the SVG element `tag`.
    fn attr(tag: &str, name: &str) -> Option<f64> {
        let at = tag.find(&format!(" {name}=\""))? + name.len() + 3;
        tag[at..].split('"').next()?.parse().ok()
    }

    #[test]
    fn csv_quotes_fields_with_commas_and_quotes() {
        assert_eq!(field("plain"), "plain");
        assert_eq!(field("4096 pages, 1 vCPU"), "\"4096 pages, 1 vCPU\"");
        assert_eq!(field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn tables_write_their_columns_and_quoted_cells() {
        let dir = ftvm_testkit::scratch::Scratch::new("bench-report-table").unwrap();
        let path = dir.join("t.csv");
        let table = Table { columns: vec!["case", "ratio"], rows: vec![vec!["4096 pages, 1 vCPU".into(), "0.5".into()]] };
        table.write_csv(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "case,ratio\n\"4096 pages, 1 vCPU\",0.5\n");
    }

    #[test]
    fn bars_sit_on_their_labels_and_axes_have_titles() {
        let dir = ftvm_testkit::scratch::Scratch::new("bench-report").unwrap();
        let path = dir.join("chart.svg");
        let bars = vec![("first case".to_owned(), 1.0), ("second, a longer one".to_owned(), 0.5), ("third".to_owned(), 0.8)];
        let chart = BarChart {
            title: "a small chart",
            category: "workload and epoch",
            quantity: "throughput relative to the unreplicated VM (ratio)",
            bars,
            reference: Some(1.0),
        };
        write_bar_chart(&path, &chart).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();

        assert!(svg.contains(">\nworkload and epoch\n</text>"), "no x axis title");
        assert!(svg.contains(">\nthroughput relative to the unreplicated VM (ratio)\n</text>"), "no y axis title");
        // Bars: the semi-transparent blue rectangles, left to right.
        let mut centres: Vec<(f64, f64)> = svg
            .split('<')
            .filter(|t| t.starts_with("rect") && t.contains("fill=\"#0000FF\""))
            .map(|t| (attr(t, "x").unwrap() + attr(t, "width").unwrap() / 2.0, attr(t, "height").unwrap()))
            .collect();
        centres.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(centres.len(), 3, "{svg}");
        // Heights in proportion to the values.
        assert!((centres[1].1 / centres[0].1 - 0.5).abs() < 0.02, "{centres:?}");
        for (i, (label, _)) in chart.bars.iter().enumerate() {
            let text = svg.split('<').find(|t| t.starts_with("text") && t.ends_with(&format!(">\n{label}\n"))).expect("label drawn");
            let x = attr(text, "x").unwrap();
            assert!((x - centres[i].0).abs() <= 1.0, "label {label:?} at x={x}, its bar centred at {}", centres[i].0);
        }
    }
}
