//! The simulator's outputs: a Markdown table, a per-minute CSV and an SVG plot (written by
//! hand: a few polylines need no plotting crate).

use super::{Outcome, Strategy};

/// The results as a Markdown table.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut s = String::from(
        "| policy | GPUs | completed | wait p50 (s) | wait p99 (s) | latency p50 (s) | latency p99 (s) | merged | dynamic, GPU slot | after host-cache load | after disk load | promotions | demotions |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for o in outcomes {
        s.push_str(&format!(
            "| {} | {} | {}/{} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {} | {} |\n",
            o.strategy.name(),
            o.gpus,
            o.completed,
            o.requests,
            o.wait_p50,
            o.wait_p99,
            o.latency_p50,
            o.latency_p99,
            100.0 * o.served[0],
            100.0 * o.served[1],
            100.0 * o.served[2],
            100.0 * o.served[3],
            o.promotions,
            o.demotions
        ));
    }
    s
}

/// Per minute and policy: arrivals, merged pods serving, p99 wait.
pub fn csv(outcomes: &[Outcome]) -> String {
    let mut s = String::from("minute,policy,gpus,arrivals,merged_pods,p99_wait_s\n");
    for o in outcomes {
        for (i, m) in o.timeline.iter().enumerate() {
            s.push_str(&format!(
                "{i},{},{},{},{},{:.3}\n",
                o.strategy.name(),
                o.gpus,
                m.arrivals,
                m.merged_pods,
                m.p99_wait
            ));
        }
    }
    s
}

const COLORS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// An SVG plot: p99 wait per minute (log scale) of each run above, arrivals per minute and the
/// `traffic` runs' merged pods below.
pub fn svg(outcomes: &[Outcome], title: &str) -> String {
    let (w, h) = (900.0, 560.0);
    let (left, right, top) = (70.0, 20.0, 40.0);
    let plot_w = w - left - right;
    let (upper_h, lower_top, lower_h) = (300.0, 390.0, 130.0);
    let minutes = outcomes
        .iter()
        .map(|o| o.timeline.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let x = |i: usize| left + plot_w * i as f64 / (minutes - 1) as f64;
    // Log scale from 10 ms to the worst p99 (at least 10 s).
    let lo: f64 = 0.01;
    let hi = outcomes
        .iter()
        .flat_map(|o| o.timeline.iter().map(|m| m.p99_wait))
        .fold(10.0f64, f64::max);
    let y = |v: f64| {
        let f = (v.max(lo).ln() - lo.ln()) / (hi.ln() - lo.ln());
        top + upper_h * (1.0 - f)
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"22\" font-size=\"15\">{}</text>\n",
        escape(title)
    );
    // Axes and decades.
    let mut v = lo;
    while v <= hi * 1.0001 {
        s.push_str(&format!(
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            left + plot_w,
            left - 6.0,
            y(v) + 4.0,
            if v < 1.0 { format!("{v}") } else { format!("{v:.0}") },
            y = y(v)
        ));
        v *= 10.0;
    }
    s.push_str(&format!(
        "<text x=\"16\" y=\"{:.0}\" transform=\"rotate(-90 16 {:.0})\" text-anchor=\"middle\">p99 wait per minute (s, log)</text>\n",
        top + upper_h / 2.0,
        top + upper_h / 2.0
    ));
    for (k, o) in outcomes.iter().enumerate() {
        let pts: Vec<String> = o
            .timeline
            .iter()
            .enumerate()
            .map(|(i, m)| format!("{:.1},{:.1}", x(i), y(m.p99_wait)))
            .collect();
        let color = COLORS[k % COLORS.len()];
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" points=\"{}\"/>\n\
             <text x=\"{:.0}\" y=\"{:.0}\" fill=\"{color}\">{} ({} GPUs), p99 {:.2} s</text>\n",
            pts.join(" "),
            left + 10.0,
            top + 16.0 + 15.0 * k as f64,
            o.strategy.name(),
            o.gpus,
            o.wait_p99
        ));
    }
    // Lower panel: arrivals per minute (grey) and merged pods of the traffic runs.
    let max_arr = outcomes
        .iter()
        .flat_map(|o| o.timeline.iter().map(|m| m.arrivals))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let max_pods = outcomes
        .iter()
        .filter(|o| o.strategy.merges())
        .flat_map(|o| o.timeline.iter().map(|m| m.merged_pods))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let ly = |f: f64| lower_top + lower_h * (1.0 - f);
    s.push_str(&format!(
        "<line x1=\"{left}\" x2=\"{}\" y1=\"{:.0}\" y2=\"{:.0}\" stroke=\"#999\"/>\n",
        left + plot_w,
        lower_top + lower_h,
        lower_top + lower_h
    ));
    if let Some(o) = outcomes.first() {
        let pts: Vec<String> = o
            .timeline
            .iter()
            .enumerate()
            .map(|(i, m)| format!("{:.1},{:.1}", x(i), ly(m.arrivals as f64 / max_arr)))
            .collect();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"#999\" stroke-width=\"1\" points=\"{}\"/>\n\
             <text x=\"{left}\" y=\"{:.0}\" fill=\"#777\">arrivals per minute (max {max_arr:.0})</text>\n",
            pts.join(" "),
            lower_top - 6.0
        ));
    }
    for (k, o) in outcomes.iter().enumerate() {
        if !o.strategy.merges() {
            continue;
        }
        let pts: Vec<String> = o
            .timeline
            .iter()
            .enumerate()
            .map(|(i, m)| format!("{:.1},{:.1}", x(i), ly(m.merged_pods as f64 / max_pods)))
            .collect();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-dasharray=\"4 2\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            COLORS[k % COLORS.len()],
            pts.join(" ")
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"end\" fill=\"#777\">dashed: merged pods of the traffic policy (max {max_pods:.0})</text>\n\
         <text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"middle\">minute</text>\n</svg>\n",
        left + plot_w,
        lower_top - 6.0,
        left + plot_w / 2.0,
        lower_top + lower_h + 24.0
    ));
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One point of the crossover study: every policy's outcome at one dynamic ÷ merged ratio.
#[derive(Debug, Clone)]
pub struct CrossoverRow {
    /// One dynamic adapter's rate ÷ merged (both batch sizes).
    pub ratio: f64,
    /// The policies' outcomes at that ratio.
    pub outcomes: Vec<Outcome>,
}

/// The crossover study as Markdown: p99 wait per policy (columns) and ratio (rows), with the
/// merges the traffic policies made.
pub fn crossover_table(rows: &[CrossoverRow]) -> String {
    let Some(first) = rows.first() else {
        return String::new();
    };
    let mut s = String::from("| dynamic ÷ merged |");
    for o in &first.outcomes {
        s.push_str(&format!(
            " {} ({} GPUs) p99 wait s |",
            o.strategy.name(),
            o.gpus
        ));
    }
    s.push_str(" merges (traffic / traffic-share) |\n|---|");
    for _ in &first.outcomes {
        s.push_str("---|");
    }
    s.push_str("---|\n");
    for r in rows {
        s.push_str(&format!("| {:.2} |", r.ratio));
        let best = r
            .outcomes
            .iter()
            .filter(|o| o.strategy != Strategy::AllMerged)
            .map(|o| o.wait_p99)
            .fold(f64::INFINITY, f64::min);
        for o in &r.outcomes {
            let done = if o.completed < o.requests {
                format!(" ({}/{} done)", o.completed, o.requests)
            } else {
                String::new()
            };
            if o.strategy != Strategy::AllMerged && o.wait_p99 == best {
                s.push_str(&format!(" **{:.2}**{done} |", o.wait_p99));
            } else {
                s.push_str(&format!(" {:.2}{done} |", o.wait_p99));
            }
        }
        let merges = |k: Strategy| {
            r.outcomes
                .iter()
                .find(|o| o.strategy == k)
                .map_or("-".to_string(), |o| o.promotions.to_string())
        };
        s.push_str(&format!(
            " {} / {} |\n",
            merges(Strategy::Traffic),
            merges(Strategy::TrafficShares)
        ));
    }
    s
}

/// The crossover study as an SVG plot: p99 wait (log scale) against dynamic ÷ merged, one line
/// per policy.
pub fn crossover_svg(rows: &[CrossoverRow], title: &str) -> String {
    let (w, h) = (760.0, 420.0);
    let (left, right, top, bottom) = (70.0, 20.0, 40.0, 50.0);
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let ratios: Vec<f64> = rows.iter().map(|r| r.ratio).collect();
    let (rmin, rmax) = (
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    let span = (rmax - rmin).max(1e-9);
    let max_wait = rows
        .iter()
        .flat_map(|r| r.outcomes.iter().map(|o| o.wait_p99))
        .fold(1.0f64, f64::max);
    let floor = 0.01f64;
    let y = |v: f64| {
        let l = (v.max(floor) / floor).log10() / (max_wait.max(floor * 10.0) / floor).log10();
        top + plot_h * (1.0 - l)
    };
    let x = |r: f64| left + plot_w * (r - rmin) / span;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"22\" font-size=\"14\">{}</text>\n\
         <line x1=\"{left}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"#999\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">one dynamic adapter ÷ merged</text>\n\
         <text x=\"16\" y=\"{}\" transform=\"rotate(-90 16 {})\" text-anchor=\"middle\">p99 wait (s, log)</text>\n",
        escape(title),
        left + plot_w,
        top + plot_h,
        top + plot_h,
        left + plot_w / 2.0,
        h - 12.0,
        top + plot_h / 2.0,
        top + plot_h / 2.0
    );
    for r in &ratios {
        s.push_str(&format!(
            "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"middle\" fill=\"#555\">{r:.1}</text>\n",
            x(*r),
            top + plot_h + 16.0
        ));
    }
    for v in [0.01, 0.1, 1.0, 10.0, 100.0, 1000.0] {
        if v <= max_wait * 1.5 {
            s.push_str(&format!(
                "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"end\" fill=\"#555\">{v}</text>\n",
                left - 6.0,
                y(v) + 4.0
            ));
        }
    }
    let n = rows.first().map_or(0, |r| r.outcomes.len());
    for k in 0..n {
        let pts: Vec<String> = rows
            .iter()
            .filter_map(|r| r.outcomes.get(k).map(|o| (r.ratio, o.wait_p99)))
            .map(|(r, v)| format!("{:.1},{:.1}", x(r), y(v)))
            .collect();
        let color = COLORS[k % COLORS.len()];
        let label = rows[0].outcomes[k].strategy.name();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.8\" points=\"{}\"/>\n\
             <text x=\"{:.0}\" y=\"{:.0}\" fill=\"{color}\">{label} ({} GPUs)</text>\n",
            pts.join(" "),
            left + plot_w - 170.0,
            top + 14.0 + 15.0 * k as f64,
            rows[0].outcomes[k].gpus
        ));
    }
    s.push_str("</svg>\n");
    s
}
