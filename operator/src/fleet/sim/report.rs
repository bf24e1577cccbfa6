//! The simulator's outputs: a Markdown table, a per-minute CSV and an SVG plot (written by
//! hand: a few polylines need no plotting crate).

use super::Outcome;

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
        .filter(|o| o.strategy == super::Strategy::Traffic)
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
        if o.strategy != super::Strategy::Traffic {
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
