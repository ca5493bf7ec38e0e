package loadtest

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// plotParsed is what the tests read back from a chart.
type plotParsed struct {
	width, height string
	// series maps a percentile name to its polyline's points.
	series map[string][][2]float64
	// texts maps a text element's class (or "" without one) to its contents.
	texts map[string][]string
	// allText is every piece of character data, in order.
	allText []string
}

// plotParse decodes svg with encoding/xml, failing the test on any error, so
// every test also checks that the output is well-formed XML.
func plotParse(t *testing.T, svg []byte) plotParsed {
	t.Helper()
	p := plotParsed{series: map[string][][2]float64{}, texts: map[string][]string{}}
	dec := xml.NewDecoder(bytes.NewReader(svg))
	var stack []xml.StartElement
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("output is not well-formed XML: %v\n%s", err, svg)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			stack = append(stack, tok)
			attr := func(name string) string {
				for _, a := range tok.Attr {
					if a.Name.Local == name {
						return a.Value
					}
				}
				return ""
			}
			switch tok.Name.Local {
			case "svg":
				if len(stack) == 1 {
					p.width, p.height = attr("width"), attr("height")
				}
			case "polyline":
				name := attr("data-series")
				if _, dup := p.series[name]; dup {
					t.Errorf("two polylines for series %q", name)
				}
				var pts [][2]float64
				for _, xy := range strings.Fields(attr("points")) {
					xs, ys, ok := strings.Cut(xy, ",")
					x, errX := strconv.ParseFloat(xs, 64)
					y, errY := strconv.ParseFloat(ys, 64)
					if !ok || errX != nil || errY != nil || math.IsNaN(x+y) || math.IsInf(x+y, 0) {
						t.Fatalf("series %q: bad point %q", name, xy)
					}
					pts = append(pts, [2]float64{x, y})
				}
				p.series[name] = pts
			}
		case xml.EndElement:
			stack = stack[:len(stack)-1]
		case xml.CharData:
			s := strings.TrimSpace(string(tok))
			if s == "" || len(stack) == 0 {
				continue
			}
			p.allText = append(p.allText, s)
			if top := stack[len(stack)-1]; top.Name.Local == "text" {
				class := ""
				for _, a := range top.Attr {
					if a.Name.Local == "class" {
						class = a.Value
					}
				}
				p.texts[class] = append(p.texts[class], s)
			}
		}
	}
	if len(stack) != 0 {
		t.Fatalf("unclosed elements at end of output: %v", stack)
	}
	return p
}

func plotRenderT(t *testing.T, title string, points []LoadPoint) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := PlotSVG(&buf, title, points); err != nil {
		t.Fatalf("PlotSVG: %v", err)
	}
	return buf.Bytes()
}

// plotSample is a realistic run: flat latency, then a knee past 4k calls/s.
// It is deliberately not sorted by Offered.
func plotSample() []LoadPoint {
	return []LoadPoint{
		{Offered: 3000, Achieved: 2998, P50: 4 * time.Millisecond, P95: 9 * time.Millisecond, P99: 15 * time.Millisecond, P999: 31 * time.Millisecond},
		{Offered: 500, Achieved: 500, P50: 2100 * time.Microsecond, P95: 4 * time.Millisecond, P99: 6 * time.Millisecond, P999: 11 * time.Millisecond},
		{Offered: 1000, Achieved: 999.6, P50: 2300 * time.Microsecond, P95: 4500 * time.Microsecond, P99: 7 * time.Millisecond, P999: 14 * time.Millisecond},
		{Offered: 5000, Achieved: 4410, P50: 180 * time.Millisecond, P95: 900 * time.Millisecond, P99: 1400 * time.Millisecond, P999: 2300 * time.Millisecond},
		{Offered: 2000, Achieved: 2001, P50: 2900 * time.Microsecond, P95: 6 * time.Millisecond, P99: 9 * time.Millisecond, P999: 19 * time.Millisecond},
		{Offered: 4000, Achieved: 3950, P50: 9 * time.Millisecond, P95: 40 * time.Millisecond, P99: 95 * time.Millisecond, P999: 260 * time.Millisecond},
	}
}

func TestPlotSVGStructure(t *testing.T) {
	points := plotSample()
	p := plotParse(t, plotRenderT(t, "ledger bench: dev, 3 partitions", points))

	if p.width != "900" || p.height != "520" {
		t.Errorf("svg size = %sx%s, want 900x520", p.width, p.height)
	}
	var names []string
	for name, pts := range p.series {
		names = append(names, name)
		if len(pts) != len(points) {
			t.Errorf("series %q has %d points, want %d", name, len(pts), len(points))
		}
		for i := 1; i < len(pts); i++ {
			if pts[i][0] <= pts[i-1][0] {
				t.Errorf("series %q: x not increasing at point %d: %v", name, i, pts)
			}
		}
	}
	slices.Sort(names)
	if want := []string{"p50", "p95", "p99", "p99.9"}; !cmp.Equal(names, want) {
		t.Errorf("series = %v, want %v", names, want)
	}
	checks := []struct {
		class string
		want  []string
	}{
		{"title", []string{"ledger bench: dev, 3 partitions"}},
		{"xtitle", []string{"offered load (calls/s)"}},
		{"ytitle", []string{"end-to-end latency (ms, log scale)"}},
	}
	for _, c := range checks {
		if got := p.texts[c.class]; !cmp.Equal(got, c.want) {
			t.Errorf("text of class %q = %q, want %q", c.class, got, c.want)
		}
	}
	// Tick labels: round calls/s on x, 1-2-5 milliseconds on y, the legend,
	// and the achieved rates under the points.
	for _, want := range []string{"0", "1k", "2k", "5k", "2", "10", "100", "1000", "5000", "p50", "p95", "p99", "p99.9", "achieved", "500", "1k", "2k", "3k", "3.95k", "4.41k"} {
		if !slices.Contains(p.allText, want) {
			t.Errorf("chart has no text %q; texts: %q", want, p.allText)
		}
	}
}

func TestPlotSVGEscapesText(t *testing.T) {
	title := `<script>alert("x")</script> & 'quotes' ]]>`
	svg := plotRenderT(t, title, plotSample())
	if bytes.Contains(svg, []byte("<script")) {
		t.Errorf("output contains an unescaped <script tag:\n%s", svg)
	}
	p := plotParse(t, svg)
	if got := p.texts["title"]; !cmp.Equal(got, []string{title}) {
		t.Errorf("title read back = %q, want %q", got, title)
	}
	// The empty chart escapes its title too.
	p = plotParse(t, plotRenderT(t, title, nil))
	if got := p.texts["title"]; !cmp.Equal(got, []string{title}) {
		t.Errorf("empty chart: title read back = %q, want %q", got, title)
	}
}

// TestPlotSVGYMonotonic checks the log scale's direction across every series
// and point: a larger latency is drawn higher (smaller y), equal latencies at
// the same height.
func TestPlotSVGYMonotonic(t *testing.T) {
	points := plotSample()
	p := plotParse(t, plotRenderT(t, "t", points))
	sorted := slices.Clone(points)
	slices.SortFunc(sorted, func(a, b LoadPoint) int { return int(a.Offered - b.Offered) })

	type drawn struct {
		lat time.Duration
		y   float64
	}
	var all []drawn
	for _, s := range plotAllSeries() {
		pts := p.series[s.name]
		if len(pts) != len(sorted) {
			t.Fatalf("series %q has %d points, want %d", s.name, len(pts), len(sorted))
		}
		for i, lp := range sorted {
			all = append(all, drawn{s.value(lp), pts[i][1]})
		}
	}
	for _, a := range all {
		for _, b := range all {
			if a.lat < b.lat && !(a.y > b.y) {
				t.Errorf("latency %v drawn at y=%v, not below latency %v at y=%v", a.lat, a.y, b.lat, b.y)
			}
		}
	}
	// Every point is inside the plot area.
	for _, a := range all {
		if a.y < plotTop || a.y > plotBottom {
			t.Errorf("latency %v drawn at y=%v, outside the plot area [%d, %d]", a.lat, a.y, plotTop, plotBottom)
		}
	}
}

func TestPlotSVGNoData(t *testing.T) {
	for _, points := range [][]LoadPoint{nil, {}} {
		p := plotParse(t, plotRenderT(t, "empty run", points))
		if len(p.series) != 0 {
			t.Errorf("empty chart has series %v, want none", p.series)
		}
		if got, want := p.texts["nodata"], []string{"no data"}; !cmp.Equal(got, want) {
			t.Errorf("empty chart says %q, want %q", got, want)
		}
	}
}

func TestPlotSVGDoesNotReorderCaller(t *testing.T) {
	points := plotSample()
	before := slices.Clone(points)
	plotRenderT(t, "t", points)
	if diff := cmp.Diff(before, points); diff != "" {
		t.Errorf("PlotSVG changed the caller's slice (-before +after):\n%s", diff)
	}
}

// TestPlotSVGZeroLatency checks that 0 (and negative) latencies, a single
// point and identical values all give a drawable chart.
func TestPlotSVGZeroLatency(t *testing.T) {
	cases := []struct {
		name   string
		points []LoadPoint
	}{
		{"all zero", []LoadPoint{{Offered: 100, Achieved: 100}}},
		{"zero offered", []LoadPoint{{Offered: 0, Achieved: 0, P50: time.Millisecond, P95: time.Millisecond, P99: time.Millisecond, P999: time.Millisecond}}},
		{"negative latency", []LoadPoint{{Offered: 1, Achieved: 1, P50: -time.Second, P95: 0, P99: time.Microsecond, P999: time.Hour}}},
		{"mixed zero", []LoadPoint{
			{Offered: 100, Achieved: 100, P50: 0, P95: 0, P99: 3 * time.Millisecond, P999: 7 * time.Millisecond},
			{Offered: 200, Achieved: 150, P50: time.Millisecond, P95: 2 * time.Millisecond, P99: 3 * time.Millisecond, P999: 70 * time.Millisecond},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			svg := plotRenderT(t, tc.name, tc.points)
			if bytes.Contains(svg, []byte("NaN")) || bytes.Contains(svg, []byte("Inf")) {
				t.Fatalf("output contains NaN or Inf:\n%s", svg)
			}
			p := plotParse(t, svg)
			for name, pts := range p.series {
				for _, xy := range pts {
					if xy[0] < plotLeft || xy[0] > plotRight || xy[1] < plotTop || xy[1] > plotBottom {
						t.Errorf("series %q: point %v outside the plot area", name, xy)
					}
				}
			}
			// Latencies at or below 0 sit on the axis floor.
			for i, lp := range tc.points {
				if lp.P50 <= 0 {
					if y := p.series["p50"][i][1]; y != plotBottom {
						t.Errorf("p50 %v drawn at y=%v, want the floor %d", lp.P50, y, plotBottom)
					}
				}
			}
		})
	}
}

func TestPlotSVGRejectsNonFinite(t *testing.T) {
	for _, p := range []LoadPoint{{Offered: math.NaN()}, {Offered: 1, Achieved: math.Inf(1)}} {
		var buf bytes.Buffer
		if err := PlotSVG(&buf, "t", []LoadPoint{{Offered: 1, Achieved: 1}, p}); err == nil {
			t.Errorf("PlotSVG with %+v: got nil error, want one", p)
		}
		if buf.Len() != 0 {
			t.Errorf("PlotSVG with %+v wrote %d bytes before failing, want 0", p, buf.Len())
		}
	}
}

type plotFailWriter struct{ err error }

func (w plotFailWriter) Write([]byte) (int, error) { return 0, w.err }

func TestPlotSVGWriteError(t *testing.T) {
	errDisk := errors.New("disk full")
	err := PlotSVG(plotFailWriter{errDisk}, "t", plotSample())
	if !errors.Is(err, errDisk) {
		t.Errorf("PlotSVG to a failing writer = %v, want an error wrapping %v", err, errDisk)
	}
}

func TestPlotTicks(t *testing.T) {
	linear := []struct {
		lo, hi float64
		want   []string
	}{
		{500, 5000, []string{"0", "1k", "2k", "3k", "4k", "5k"}},
		{1000, 10000, []string{"0", "2k", "4k", "6k", "8k", "10k"}},
		{9000, 10000, []string{"9k", "9.2k", "9.4k", "9.6k", "9.8k", "10k"}},
		{100, 100, []string{"90", "95", "100", "105", "110"}},
		{0, 0, []string{"0", "0.2", "0.4", "0.6", "0.8", "1"}},
		{0.1, 0.7, []string{"0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7"}},
		{20000, 2.5e6, []string{"0", "500k", "1M", "1.5M", "2M", "2.5M"}},
	}
	for _, tc := range linear {
		ticks, _, _ := plotLinearTicks(tc.lo, tc.hi, 8)
		var got []string
		for _, v := range ticks {
			got = append(got, plotFormatTick(v))
		}
		if !cmp.Equal(got, tc.want) {
			t.Errorf("plotLinearTicks(%v, %v) = %q, want %q", tc.lo, tc.hi, got, tc.want)
		}
	}

	logs := []struct {
		min, max     float64
		lo, hi       float64
		major, minor []float64
	}{
		{1.3, 48, 1, 50, []float64{1, 2, 5, 10, 20, 50}, nil},
		{0.1, 0.1, 0.1, 0.2, []float64{0.1, 0.2}, nil},
		{2, 2, 2, 5, []float64{2, 5}, nil},
		{0.1, 2300, 0.1, 5000, []float64{0.1, 1, 10, 100, 1000}, []float64{0.2, 0.5, 2, 5, 20, 50, 200, 500, 2000, 5000}},
	}
	for _, tc := range logs {
		lo, hi, major, minor := plotLogTicks(tc.min, tc.max)
		approx := cmp.Comparer(func(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) })
		if !cmp.Equal([]float64{lo, hi}, []float64{tc.lo, tc.hi}, approx) || !cmp.Equal(major, tc.major, approx) || !cmp.Equal(minor, tc.minor, approx) {
			t.Errorf("plotLogTicks(%v, %v) = %v, %v, %v, %v; want %v, %v, %v, %v", tc.min, tc.max, lo, hi, major, minor, tc.lo, tc.hi, tc.major, tc.minor)
		}
	}

	rates := map[float64]string{0: "0", 5: "5", 12.34: "12.3", 987: "987", 999.6: "1k", 0.5: "0.5", 1234567: "1.23M", -1500: "-1.5k", 1000: "1k", 1950: "1.95k", 19500: "19.5k", 195000: "195k", 2e6: "2M"}
	for v, want := range rates {
		if got := plotFormatRate(v); got != want {
			t.Errorf("plotFormatRate(%v) = %q, want %q", v, got, want)
		}
	}
}

// TestPlotSVGSampleChart renders a realistic chart into a temporary
// directory, the way `ledger bench --svg` writes its file, and reads it back.
func TestPlotSVGSampleChart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bench.svg")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := PlotSVG(f, "ledger bench — dev mode, open loop, 60 s per step", plotSample()); err != nil {
		t.Fatalf("PlotSVG: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	svg, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	p := plotParse(t, svg)
	if len(p.series) != len(plotAllSeries()) {
		t.Errorf("sample chart has %d series, want %d", len(p.series), len(plotAllSeries()))
	}
	t.Logf("sample chart: %s (%d bytes)", path, len(svg))
}
