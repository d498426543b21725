package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

var variantColors = map[string]color.Color{
	vDefault:     color.RGBA{R: 0x75, G: 0x6b, B: 0xb1, A: 0xff},
	vAtLeastOnce: color.RGBA{R: 0x9e, G: 0xca, B: 0xe1, A: 0xff},
	vExactlyOnce: color.RGBA{R: 0x31, G: 0x82, B: 0xbd, A: 0xff},
	vGroupCommit: color.RGBA{R: 0x08, G: 0x51, B: 0x9c, A: 0xff},
	vBatch:       color.RGBA{R: 0x08, G: 0x30, B: 0x6b, A: 0xff},
	vExpert:      color.RGBA{R: 0xa5, G: 0x0f, B: 0x15, A: 0xff},
	vBaseline:    color.RGBA{R: 0xfd, G: 0x8d, B: 0x3c, A: 0xff},
	vDBLimit:     color.RGBA{R: 0x74, G: 0xc4, B: 0x76, A: 0xff},
	vDBLimitGo:   color.RGBA{R: 0x23, G: 0x8b, B: 0x45, A: 0xff},
}

// writeChart draws one panel per setup: for each concurrency a group of bars, one per variant,
// with the median msgs/s of the backlog drain. The file's extension chooses SVG or PNG.
func writeChart(path string, setups []setup, conc []int, res Results) error {
	var plots []*plot.Plot
	for _, st := range setups {
		p, ok, err := setupPlot(st, dbLimitSetup(setups, st), conc, res)
		if err != nil {
			return err
		}
		if ok {
			plots = append(plots, p)
		}
	}
	if len(plots) == 0 {
		return fmt.Errorf("no results to draw")
	}
	width, height := 18*vg.Centimeter, vg.Length(len(plots))*9*vg.Centimeter
	var canvas vg.CanvasWriterTo
	if strings.EqualFold(filepath.Ext(path), ".png") {
		canvas = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(width, height), vgimg.UseDPI(110), vgimg.UseBackgroundColor(color.White))}
	} else {
		canvas = vgsvg.New(width, height)
	}
	dc := draw.New(canvas)
	tiles := draw.Tiles{Rows: len(plots), Cols: 1, PadY: vg.Centimeter / 2, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2,
		PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 2}
	grid := make([][]*plot.Plot, len(plots))
	for i, p := range plots {
		grid[i] = []*plot.Plot{p}
	}
	canvases := plot.Align(grid, tiles, dc)
	for i, p := range plots {
		p.Draw(canvases[i][0])
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := canvas.WriteTo(f); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// setupPlot draws the panel of st; the database limit comes from the cells of limits.
func setupPlot(st, limits setup, conc []int, res Results) (*plot.Plot, bool, error) {
	source := func(v string) setup {
		if v == vDBLimit || v == vDBLimitGo {
			return limits
		}
		return st
	}
	var vs []string
	for _, v := range allVariants {
		for _, c := range conc {
			if rateOf(res.Medians, source(v), v, c) > 0 {
				vs = append(vs, v)
				break
			}
		}
	}
	if len(vs) == 0 {
		return nil, false, nil
	}
	p := plot.New()
	p.Title.Text = st.Title + fmt.Sprintf(" (median msgs/s of %v rounds)", res.Config["rounds"])
	p.Y.Label.Text = "messages / s"
	p.X.Label.Text = "handler concurrency (clients)"
	p.Legend.Top = true
	p.Legend.Left = true
	p.Y.Min = 0
	barWidth := vg.Points(12)
	highest := 0.0
	for i, v := range vs {
		values := make(plotter.Values, len(conc))
		for j, c := range conc {
			values[j] = rateOf(res.Medians, source(v), v, c)
			highest = max(highest, values[j])
		}
		bars, err := plotter.NewBarChart(values, barWidth)
		if err != nil {
			return nil, false, err
		}
		bars.LineStyle.Width = 0
		bars.Color = variantColors[v]
		bars.Offset = barWidth * vg.Length(float64(i)-float64(len(vs)-1)/2)
		p.Add(bars)
		label := columnTitles[v]
		if v == vDBLimit {
			label += map[bool]string{true: " (pgbench)", false: " (Go loop)"}[st.Database == "postgres"]
		}
		p.Legend.Add(label, bars)
	}
	names := make([]string, len(conc))
	for i, c := range conc {
		names[i] = fmt.Sprint(c)
	}
	p.NominalX(names...)
	p.Y.Max = highest * 1.55 // room for the legend above the bars
	return p, true, nil
}

// runChart draws the chart of an earlier run's results file.
func runChart(args []string) error {
	fs := flag.NewFlagSet("chart", flag.ContinueOnError)
	in := fs.String("in", "bench/results/latest.json", "results file of onceflow-bench run")
	out := fs.String("out", "docs/performance.svg", "chart file (.svg or .png)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	b, err := os.ReadFile(*in)
	if err != nil {
		return err
	}
	var res Results
	if err := json.Unmarshal(b, &res); err != nil {
		return fmt.Errorf("%s: %w", *in, err)
	}
	var setups []setup
	var conc []int
	for _, st := range allSetups {
		if slices.ContainsFunc(res.Medians, func(e Entry) bool { return strings.HasPrefix(e.Name, st.Name+"/") }) {
			setups = append(setups, st)
		}
	}
	for _, e := range res.Medians {
		if e.Scenario != "" && e.Scenario != scenarioDrain {
			continue
		}
		if !slices.Contains(conc, e.Concurrency) {
			conc = append(conc, e.Concurrency)
		}
	}
	slices.Sort(conc)
	return writeChart(*out, setups, conc, res)
}
