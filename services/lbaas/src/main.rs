use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kuryr_lbaas::run(kuryr_lbaas::Config::parse()).await
}
