package loadtest

import (
	"cmp"
	"encoding/xml"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// LoadPoint is one step of an open-loop load test: the load offered and the
// latency percentiles measured at that load.
type LoadPoint struct {
	// Offered is the load offered, in calls per second. The generator is
	// open loop, so this is the arrival rate whatever the ledger managed.
	Offered float64
	// Achieved is the rate of calls completed, in calls per second. It falls
	// below Offered once the ledger saturates, which is where latency climbs.
	Achieved float64
	// P50 is the median end-to-end latency.
	P50 time.Duration
	// P95 is the 95th percentile end-to-end latency.
	P95 time.Duration
	// P99 is the 99th percentile end-to-end latency.
	P99 time.Duration
	// P999 is the 99.9th percentile end-to-end latency.
	P999 time.Duration
}

// Chart geometry, in SVG user units (pixels).
const (
	plotWidth  = 900
	plotHeight = 520
	plotLeft   = 80  // left edge of the plot area, after the y labels
	plotRight  = 870 // right edge of the plot area
	plotTop    = 70  // below the title and the legend
	plotBottom = 400 // above the x labels, achieved row and x title
	// plotPadX keeps the first and last points off the plot's edges, so
	// their markers and achieved labels stay clear of the y axis and labels.
	plotPadX = 24

	// plotMinMs is the floor of the latency axis: a latency of 0 (or below
	// the floor) is drawn on it, because a log scale has no place for 0.
	plotMinMs = 0.1
)

// plotSeries describes one percentile line.
type plotSeries struct {
	name   string
	color  string
	marker string // circle, square, triangle or diamond: readable without colour
	value  func(LoadPoint) time.Duration
}

// plotAllSeries returns the percentile lines in drawing order, so the tail
// is drawn on top. It is a function so the package holds no mutable global.
func plotAllSeries() [4]plotSeries {
	return [...]plotSeries{
		{"p50", "#1f77b4", "circle", func(p LoadPoint) time.Duration { return p.P50 }},
		{"p95", "#2ca02c", "square", func(p LoadPoint) time.Duration { return p.P95 }},
		{"p99", "#ff7f0e", "triangle", func(p LoadPoint) time.Duration { return p.P99 }},
		{"p99.9", "#d62728", "diamond", func(p LoadPoint) time.Duration { return p.P999 }},
	}
}

// PlotSVG writes a 900x520 SVG chart of latency percentiles against offered
// load, for BENCHMARKS.md and `ledger bench --svg`: offered calls/s on a
// linear x axis, latency in milliseconds on a log y axis, one line per
// percentile (p50, p95, p99, p99.9), and the achieved calls/s printed under
// the points so that saturation is visible next to the latency knee.
//
// points may be in any order (they are drawn sorted by Offered; the caller's
// slice is not modified). With no points the chart says "no data". Offered
// and Achieved must be finite. The SVG uses the standard library only and
// escapes all text, so any title is safe to embed.
func PlotSVG(w io.Writer, title string, points []LoadPoint) error {
	for i, p := range points {
		if math.IsNaN(p.Offered) || math.IsInf(p.Offered, 0) || math.IsNaN(p.Achieved) || math.IsInf(p.Achieved, 0) {
			return fmt.Errorf("loadtest: plot point %d: offered %v and achieved %v calls/s must be finite", i, p.Offered, p.Achieved)
		}
	}
	var b strings.Builder
	plotRender(&b, title, points)
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("loadtest: write svg: %w", err)
	}
	return nil
}

func plotRender(b *strings.Builder, title string, points []LoadPoint) {
	fmt.Fprintf(b, `<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif">
<title>%s</title>
<rect width="%d" height="%d" fill="#ffffff"/>
<text class="title" x="%d" y="28" text-anchor="middle" font-size="17" font-weight="bold">%s</text>
`, plotWidth, plotHeight, plotWidth, plotHeight, plotEsc(title), plotWidth, plotHeight, plotWidth/2, plotEsc(title))

	if len(points) == 0 {
		fmt.Fprintf(b, `<text class="nodata" x="%d" y="%d" text-anchor="middle" font-size="16" fill="#666666">no data</text>
</svg>
`, plotWidth/2, plotHeight/2)
		return
	}

	pts := slices.Clone(points)
	slices.SortStableFunc(pts, func(a, b LoadPoint) int { return cmp.Compare(a.Offered, b.Offered) })

	// Axes ranges.
	xLo, xHi := pts[0].Offered, pts[len(pts)-1].Offered
	xTicks, xLo, xHi := plotLinearTicks(xLo, xHi, 8)
	minMs, maxMs := math.Inf(1), math.Inf(-1)
	for _, p := range pts {
		for _, s := range plotAllSeries() {
			ms := plotMs(s.value(p))
			minMs, maxMs = math.Min(minMs, ms), math.Max(maxMs, ms)
		}
	}
	yLo, yHi, yMajor, yMinor := plotLogTicks(minMs, maxMs)

	xPos := func(v float64) float64 {
		return plotLeft + plotPadX + (v-xLo)/(xHi-xLo)*(plotRight-plotLeft-2*plotPadX)
	}
	yPos := func(ms float64) float64 {
		return plotBottom - (math.Log10(ms)-math.Log10(yLo))/(math.Log10(yHi)-math.Log10(yLo))*(plotBottom-plotTop)
	}

	// Legend, in one row under the title.
	const legendItem = 100
	lx := plotWidth/2 - len(plotAllSeries())*legendItem/2
	b.WriteString(`<g class="legend" font-size="13">` + "\n")
	for i, s := range plotAllSeries() {
		x := float64(lx + i*legendItem)
		fmt.Fprintf(b, `<line x1="%s" y1="50" x2="%s" y2="50" stroke="%s" stroke-width="2"/>`+"\n", plotF(x), plotF(x+28), s.color)
		plotMarker(b, s, x+14, 50, "")
		fmt.Fprintf(b, `<text x="%s" y="54">%s</text>`+"\n", plotF(x+34), plotEsc(s.name))
	}
	b.WriteString("</g>\n")

	// Grid and tick labels.
	b.WriteString(`<g class="grid" stroke="#e6e6e6" stroke-width="1">` + "\n")
	for _, v := range xTicks {
		fmt.Fprintf(b, `<line x1="%s" y1="%d" x2="%s" y2="%d"/>`+"\n", plotF(xPos(v)), plotTop, plotF(xPos(v)), plotBottom)
	}
	for _, v := range yMinor {
		fmt.Fprintf(b, `<line x1="%d" y1="%s" x2="%d" y2="%s" stroke="#f2f2f2"/>`+"\n", plotLeft, plotF(yPos(v)), plotRight, plotF(yPos(v)))
	}
	for _, v := range yMajor {
		fmt.Fprintf(b, `<line x1="%d" y1="%s" x2="%d" y2="%s"/>`+"\n", plotLeft, plotF(yPos(v)), plotRight, plotF(yPos(v)))
	}
	b.WriteString("</g>\n")
	fmt.Fprintf(b, `<g class="axes" stroke="#333333" stroke-width="1">
<line x1="%d" y1="%d" x2="%d" y2="%d"/>
<line x1="%d" y1="%d" x2="%d" y2="%d"/>
</g>
`, plotLeft, plotTop, plotLeft, plotBottom, plotLeft, plotBottom, plotRight, plotBottom)

	b.WriteString(`<g class="xticks" font-size="12" text-anchor="middle" fill="#333333">` + "\n")
	for _, v := range xTicks {
		fmt.Fprintf(b, `<text x="%s" y="%d">%s</text>`+"\n", plotF(xPos(v)), plotBottom+18, plotEsc(plotFormatTick(v)))
	}
	b.WriteString("</g>\n")
	b.WriteString(`<g class="yticks" font-size="12" text-anchor="end" fill="#333333">` + "\n")
	for _, v := range yMajor {
		fmt.Fprintf(b, `<text x="%d" y="%s">%s</text>`+"\n", plotLeft-8, plotF(yPos(v)+4), plotEsc(plotTrim(v)))
	}
	b.WriteString("</g>\n")

	// Achieved calls/s under each point, skipping labels that would overlap.
	// A step that completes under 95% of its offered load is in red: the
	// ledger is saturated there.
	fmt.Fprintf(b, `<g class="achieved" font-size="10" text-anchor="middle" fill="#555555">
<text x="%d" y="%d" text-anchor="end">achieved</text>
`, plotLeft-8, plotBottom+36)
	lastX := math.Inf(-1)
	for _, p := range pts {
		x := xPos(p.Offered)
		if x-lastX < 36 {
			continue
		}
		lastX = x
		fill := ""
		if p.Offered > 0 && p.Achieved < 0.95*p.Offered {
			fill = ` fill="#b00020"`
		}
		fmt.Fprintf(b, `<text x="%s" y="%d"%s>%s</text>`+"\n", plotF(x), plotBottom+36, fill, plotEsc(plotFormatRate(p.Achieved)))
	}
	b.WriteString("</g>\n")

	// Axis titles.
	fmt.Fprintf(b, `<text class="xtitle" x="%d" y="%d" text-anchor="middle" font-size="13">%s</text>
<text class="ytitle" x="0" y="0" transform="translate(22 %d) rotate(-90)" text-anchor="middle" font-size="13">%s</text>
`, (plotLeft+plotRight)/2, plotBottom+68, plotEsc("offered load (calls/s)"),
		(plotTop+plotBottom)/2, plotEsc("end-to-end latency (ms, log scale)"))

	// One line and its markers per percentile.
	for _, s := range plotAllSeries() {
		coords := make([]string, len(pts))
		for i, p := range pts {
			coords[i] = plotF(xPos(p.Offered)) + "," + plotF(yPos(plotMs(s.value(p))))
		}
		fmt.Fprintf(b, `<polyline class="series" data-series="%s" fill="none" stroke="%s" stroke-width="2" stroke-linejoin="round" points="%s"/>`+"\n",
			plotEsc(s.name), s.color, strings.Join(coords, " "))
		fmt.Fprintf(b, `<g class="markers" data-series="%s">`+"\n", plotEsc(s.name))
		for _, p := range pts {
			d := s.value(p)
			tip := fmt.Sprintf("%s at %s calls/s offered (%s achieved): %s ms",
				s.name, plotFormatRate(p.Offered), plotFormatRate(p.Achieved), strconv.FormatFloat(float64(d)/1e6, 'f', 3, 64))
			plotMarker(b, s, xPos(p.Offered), yPos(plotMs(d)), tip)
		}
		b.WriteString("</g>\n")
	}
	b.WriteString("</svg>\n")
}

// plotMarker draws one point marker of the series' shape, with an optional
// tooltip.
func plotMarker(b *strings.Builder, s plotSeries, x, y float64, tip string) {
	const r = 4.0
	var shape, end string
	switch s.marker {
	case "square":
		shape = fmt.Sprintf(`<rect x="%s" y="%s" width="%s" height="%s" fill="%s"`, plotF(x-r+0.5), plotF(y-r+0.5), plotF(2*r-1), plotF(2*r-1), s.color)
	case "triangle":
		shape = fmt.Sprintf(`<polygon points="%s,%s %s,%s %s,%s" fill="%s"`,
			plotF(x), plotF(y-r-0.5), plotF(x-r), plotF(y+r-1), plotF(x+r), plotF(y+r-1), s.color)
	case "diamond":
		shape = fmt.Sprintf(`<polygon points="%s,%s %s,%s %s,%s %s,%s" fill="%s"`,
			plotF(x), plotF(y-r-0.5), plotF(x+r+0.5), plotF(y), plotF(x), plotF(y+r+0.5), plotF(x-r-0.5), plotF(y), s.color)
	default:
		shape = fmt.Sprintf(`<circle cx="%s" cy="%s" r="%s" fill="%s"`, plotF(x), plotF(y), plotF(r-0.5), s.color)
	}
	if tip == "" {
		end = "/>"
	} else {
		kind := strings.TrimPrefix(strings.Fields(shape)[0], "<")
		end = "><title>" + plotEsc(tip) + "</title></" + kind + ">"
	}
	b.WriteString(shape + end + "\n")
}

// plotMs converts a latency to milliseconds for the log axis, raising it to
// the axis floor so that 0 has a place.
func plotMs(d time.Duration) float64 {
	return math.Max(float64(d)/1e6, plotMinMs)
}

// plotLinearTicks returns round tick values (steps of 1, 2 or 5 times a
// power of ten, at most maxIntervals of them) and the axis range they span,
// covering [lo, hi]. The axis starts at 0 when the data start near it, and a
// single value gets a range around it.
func plotLinearTicks(lo, hi float64, maxIntervals int) (ticks []float64, axisLo, axisHi float64) {
	if lo >= 0 && lo < hi/4 {
		lo = 0
	}
	if hi-lo <= 0 {
		pad := math.Max(math.Abs(lo)*0.1, 1)
		if lo >= 0 && lo-pad < 0 {
			lo, hi = 0, hi+pad
		} else {
			lo, hi = lo-pad, hi+pad
		}
	}
	// The smallest round step that needs no more than maxIntervals; the one
	// before it needed more, so there are at least about maxIntervals/2.5.
	var first, last float64
	base := math.Pow(10, math.Floor(math.Log10((hi-lo)/float64(maxIntervals))))
	for _, m := range []float64{1, 2, 5, 10, 20} {
		step := m * base
		first = math.Floor(lo/step + 1e-9)
		last = math.Ceil(hi/step - 1e-9)
		if last-first <= float64(maxIntervals) {
			base = step
			break
		}
	}
	for i := first; i <= last; i++ {
		ticks = append(ticks, i*base)
	}
	return ticks, first * base, last * base
}

// plotLogTicks returns a log axis range from the 1-2-5 tick at or below minMs
// to the one at or above maxMs, with its labelled (major) ticks and unlabelled
// (minor) grid lines. A wide range labels only the decades so the labels do
// not crowd.
func plotLogTicks(minMs, maxMs float64) (lo, hi float64, major, minor []float64) {
	var cands []float64
	for e := int(math.Floor(math.Log10(minMs))) - 1; e <= int(math.Ceil(math.Log10(maxMs)))+1; e++ {
		for _, m := range []float64{1, 2, 5} {
			cands = append(cands, m*math.Pow10(e))
		}
	}
	loI, hiI := 0, len(cands)-1
	for i, c := range cands {
		if c <= minMs*(1+1e-9) {
			loI = i
		}
	}
	for i := len(cands) - 1; i >= 0; i-- {
		if cands[i] >= maxMs*(1-1e-9) {
			hiI = i
		}
	}
	if hiI <= loI {
		hiI = loI + 1
	}
	ticks := cands[loI : hiI+1]
	if len(ticks) <= 13 {
		return ticks[0], ticks[len(ticks)-1], ticks, nil
	}
	for i, t := range ticks {
		if (loI+i)%3 == 0 { // a power of ten: cands go 1, 2, 5 per decade
			major = append(major, t)
		} else {
			minor = append(minor, t)
		}
	}
	return ticks[0], ticks[len(ticks)-1], major, minor
}

// plotFormatTick writes a round axis value briefly: 500, 1k, 1.5k, 2M, 0.2.
func plotFormatTick(v float64) string {
	a := math.Abs(v)
	switch {
	case a >= 1e6:
		return plotTrim(v/1e6) + "M"
	case a >= 1e3:
		return plotTrim(v/1e3) + "k"
	default:
		return plotTrim(v)
	}
}

// plotTrim formats v without the float noise of tick arithmetic
// (0.30000000000000004 is "0.3").
func plotTrim(v float64) string {
	return strconv.FormatFloat(math.Round(v*1e6)/1e6, 'f', -1, 64)
}

// plotFormatRate writes a measured rate with three significant digits at
// most: 987, 1k (for 999.6), 1.95k, 19.5k, 195k, 1.23M.
func plotFormatRate(v float64) string {
	if v != 0 {
		p := math.Pow(10, math.Floor(math.Log10(math.Abs(v)))-2)
		v = math.Round(v/p) * p
	}
	unit := ""
	switch a := math.Abs(v); {
	case a >= 1e6:
		v, unit = v/1e6, "M"
	case a >= 1e3:
		v, unit = v/1e3, "k"
	}
	var s string
	switch a := math.Abs(v); {
	case a < 10:
		s = strconv.FormatFloat(v, 'f', 2, 64)
	case a < 100:
		s = strconv.FormatFloat(v, 'f', 1, 64)
	default:
		s = strconv.FormatFloat(v, 'f', 0, 64)
	}
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s + unit
}

// plotF formats a coordinate.
func plotF(v float64) string {
	return strconv.FormatFloat(v, 'f', 1, 64)
}

// plotEsc escapes text for XML content and attributes.
func plotEsc(s string) string {
	var b strings.Builder
	_ = xml.EscapeText(&b, []byte(s)) // a strings.Builder never fails
	return b.String()
}
